"""A bf16 forward of 1-4 new tokens with the packed products' fewest rows at 2 (before) and at 4 (what a CPU with
native bf16 dot products gets now, decoder/packed_linear.py), timed in turns in one process, and whether the
logits are bitwise the same.

Run from the repository root: python docs/benchmarks/bf16_fewest_rows.py [--context 300] [--rounds 10]

Each round times every (fewest rows, rows) pair once, so that a slow spell of a shared machine falls on all alike;
a cell is the median over rounds, the first round (warm-up) left out. Rows = 1 is a plain decoding step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode import load_model
from specdecode.models.decoder.packed_linear import FAST_BF16_ROWS, INVARIANT_ROWS, PackedLinear, native_bf16
from specdecode.models.formats.default_models import DEFAULT_TARGET

ROWS = (1, 2, 3, 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    model = load_model(args.model, dtype="bfloat16", quant="none", quiet=True).model
    packed = [module for module in model.modules() if isinstance(module, PackedLinear)]
    cache = model.new_cache(args.context + max(ROWS))
    samples: dict[tuple[int, int], list[float]] = {}
    logits: dict[tuple[int, int], torch.Tensor] = {}
    with torch.inference_mode():
        context = torch.arange(args.context).unsqueeze(0)  # [1, C]
        model(context % 1000, context, cache)
        for round_index in range(args.rounds + 1):
            for fewest in (INVARIANT_ROWS, FAST_BF16_ROWS):
                for module in packed:
                    module.fewest_rows = fewest
                for rows in ROWS:
                    tokens = torch.full((1, rows), 7)  # [1, M]
                    positions = torch.arange(args.context, args.context + rows).unsqueeze(0)  # [1, M]
                    start = time.perf_counter()
                    logits[fewest, rows] = model(tokens, positions, cache).logits  # [1, M, V]
                    elapsed = time.perf_counter() - start
                    cache.truncate(args.context)
                    if round_index:
                        samples.setdefault((fewest, rows), []).append(elapsed * 1000)
    print(f"{args.model}, bf16, {len(packed)} packed products, native bf16: {native_bf16()}, context {args.context}, "
          f"{torch.get_num_threads()} threads, median of {args.rounds} rounds")
    print(f"| rows | fewest {INVARIANT_ROWS}: ms | fewest {FAST_BF16_ROWS}: ms | speedup | logits bitwise equal |")
    print("|---|---:|---:|---:|---|")
    for rows in ROWS:
        before, after = (statistics.median(samples[fewest, rows]) for fewest in (INVARIANT_ROWS, FAST_BF16_ROWS))
        same = torch.equal(logits[INVARIANT_ROWS, rows], logits[FAST_BF16_ROWS, rows])
        print(f"| {rows} | {before:.1f} | {after:.1f} | {before / after:.2f}x | {same} |")


if __name__ == "__main__":
    main()
