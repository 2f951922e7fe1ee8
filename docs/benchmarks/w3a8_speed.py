"""The kernel alone at 3 bits against 4: rows through the 0.5B draft's 24 layers of linear weights, w4a8 codes
against w3a8 codes (random, each layer its own, so that the weights stream from memory as in a real forward).

    python docs/benchmarks/w3a8_speed.py [--rounds 15]

Both stacks are timed in turns, the median of the rounds reported; 2 threads.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.models.kernels.w4a8_linear import W4A8Linear, pack_tiles

# The default draft's (Qwen2.5-Coder-0.5B) decoder-layer linears, [out, in]: qkv, o, gate_up, down
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
LAYERS = 24


def stack(bits: int, generator: torch.Generator) -> list[W4A8Linear]:
    """LAYERS x SHAPES layers of random codes at `bits` bits, scales and offsets."""
    layers = []
    for _ in range(LAYERS):
        for rows, inputs in SHAPES:
            codes = torch.randint(0, 2**bits, (rows, inputs), generator=generator)  # [N, K]
            scales = torch.rand(rows, inputs // 32, generator=generator) * 0.01 + 0.001  # [N, K/32]
            offsets = torch.randn(rows, inputs // 32, generator=generator) * 0.01  # [N, K/32]
            layers.append(W4A8Linear(*pack_tiles(codes, scales, offsets, bits=bits), None))
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    stacks = {bits: stack(bits, generator) for bits in (4, 3)}
    print("| rows | w4a8 ms | w3a8 ms | w3a8 / w4a8 |\n|---:|---:|---:|---:|")
    for rows in (1, 4):
        times: dict[int, list[float]] = {4: [], 3: []}
        for _ in range(args.rounds):
            for bits, layers in stacks.items():
                inputs = [torch.randn(rows, layer.in_features) for layer in layers]  # [M, K] each
                began = time.perf_counter()
                for layer, x in zip(layers, inputs):
                    layer(x)
                times[bits].append(time.perf_counter() - began)
        four, three = statistics.median(times[4]), statistics.median(times[3])
        print(f"| {rows} | {four * 1e3:.2f} | {three * 1e3:.2f} | {three / four:.3f} |")


if __name__ == "__main__":
    main()
