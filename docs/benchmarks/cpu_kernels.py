"""Milliseconds per call of PyTorch's CPU matmul kernels for decoding, and ours, by number of rows M (tokens per
forward).

Run from the repository root: python docs/benchmarks/cpu_kernels.py [N K]
(default: every matmul shape of the 1.5B target, Qwen2.5-1.5B: qkv 2048x1536, o 1536x1536, gate_up 17920x1536,
down 1536x8960, output head 151936x1536; a table for each).

Each kernel cycles through enough copies of the weight (over 300M parameters) that none stays in the 32 MB L3
cache: a single weight reused call after call would measure the cache, not memory, and overstate the speed.
A cell is the median over 5 rounds of the mean time per call in a round (a round calls every copy once), so
that one round slowed by another process does not move it much.
Kernels: float32 (`F.linear`, the float32 path), bf16 as our bfloat16 path runs it (oneDNN with a prepacked
weight where oneDNN has a bf16 kernel for this CPU, else `F.linear` on the bf16 weight), weight-only int8 per
channel (`_weight_int8pack_mm`), weight-only int4 in groups of 32 (`_weight_int4pack_mm_for_cpu`, as
`--quant int4` calls it), and int8 x int8 with int32 accumulation (`torch._int_mm`, which needs activations
quantized too), and ours: int4 weights x int8 activations (`--quant w4a8`, specdecode/models/kernels/w4a8_kernel.cpp,
in the variant this CPU gets: AVX-512 VNNI, AVX-VNNI or AVX2, or the one SPECDECODE_W4A8_ISA names; activation
quantization included in its time).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from specdecode.models.kernels.w4a8_linear import kernel_isa, load_kernel

# int4: codes + bf16 scale and zero per 32; w4a8: codes + 8-bit scale and offset per 32 + bf16 units per 256
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.625, "int8 x int8": 1.0, "w4a8": 4.625 / 8}
SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
          "head": (151936, 1536)}  # name -> (N, K) of the 1.5B target


def per_call_ms(calls: list, rounds: int = 5) -> float:
    for call in calls[:2]:
        call()
    means = []
    for _ in range(rounds):
        start = time.perf_counter()
        for call in calls:
            call()
        means.append((time.perf_counter() - start) / len(calls) * 1000)
    return statistics.median(means)


def table(label: str, out_features: int, in_features: int, kernel) -> None:
    copies = max(2, int(300e6 // (out_features * in_features)))
    torch.manual_seed(0)
    fp32 = [torch.randn(out_features, in_features) for _ in range(copies)]
    packed = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # as specdecode/models/decoder/packed_linear.py decides
    bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 1) if packed else w.bfloat16() for w in fp32]
    int8 = [torch.randint(-127, 127, (out_features, in_features), dtype=torch.int8) for _ in range(copies)]
    int8_scales = torch.rand(out_features).bfloat16()  # [N]
    int4 = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (out_features, in_features), dtype=torch.int32), 1) for _ in range(copies)]
    int4_scales = torch.rand(in_features // 32, out_features, 2).bfloat16()  # [K/32, N, 2]
    tiles, groups = out_features // 16, in_features // 32
    w4a8 = [(torch.randint(0, 256, (tiles, groups, 256), dtype=torch.uint8),  # codes
             torch.randint(0, 256, (tiles, groups, 32), dtype=torch.uint8),  # scale and offset codes
             (torch.rand(tiles, -(-groups // 8), 32) * 1e-4).bfloat16())  # units per 256 inputs
            for _ in range(copies)]
    print(f"\n{label}: weight {out_features}x{in_features}, {copies} copies in rotation, "
          f"{torch.get_num_threads()} threads, bf16 {'prepacked' if packed else 'F.linear'}")
    print("| M | " + " | ".join(f"{name} ms" for name in BYTES_PER_WEIGHT) + " |")
    print("|---|" + "---|" * len(BYTES_PER_WEIGHT))
    for rows in (1, 2, 4, 8, 16):
        x_fp32 = torch.randn(rows, in_features)  # [M, K]
        x = x_fp32.bfloat16()  # [M, K]
        x_int8 = torch.randint(-127, 127, (rows, in_features), dtype=torch.int8)  # [M, K]
        costs = {
            "fp32": per_call_ms([lambda w=w: F.linear(x_fp32, w) for w in fp32]),
            "bf16": per_call_ms([lambda w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                 if packed else F.linear(x, w) for w in bf16]),
            "int8": per_call_ms([lambda w=w: torch.ops.aten._weight_int8pack_mm(x, w, int8_scales) for w in int8]),
            "int4": per_call_ms([lambda w=w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, 32, int4_scales)
                                 for w in int4]),
            "int8 x int8": per_call_ms([lambda w=w: torch._int_mm(x_int8, w.t()) for w in int8]),
            "w4a8": per_call_ms([lambda w=w: kernel.w4a8_mm(x.float(), *w) for w in w4a8]),
        }
        cells = []
        for name, ms in costs.items():
            bandwidth = out_features * in_features * BYTES_PER_WEIGHT[name] / ms / 1e6  # GB/s
            cells.append(f"{ms:.3f} ({bandwidth:.0f} GB/s)" if rows == 1 else f"{ms:.3f}")
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    shapes = {"given": (int(sys.argv[1]), int(sys.argv[2]))} if len(sys.argv) == 3 else SHAPES
    kernel = load_kernel(quiet=False)
    print(f"w4a8 kernel variant: {kernel_isa()}")
    for label, (out_features, in_features) in shapes.items():
        table(label, out_features, in_features, kernel)


if __name__ == "__main__":
    main()
