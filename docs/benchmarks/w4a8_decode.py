"""The 1.5B target in int4 against w4a8 (int4 weights x int8 activations): decode speed, forward cost by tokens
per forward, speculative speedups and whether speculative output equals plain decoding, all in one run.

Run from the repository root: python docs/benchmarks/w4a8_decode.py [--prompts 3] [--max-tokens 128]

Greedy, first N HumanEval prompts from ../shared/data, decode-only tokens/s (prefill excluded); the draft is
the 0.5B in int4 or w4a8.
"""

from __future__ import annotations

import argparse
import json

from cpu_decode import PROMPTS, VERIFY_ROWS, streamed_bytes, verify_cost

from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET

METHODS = ("none", "ngram", "draft", "ngram,draft")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    prompts = [json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines()[: args.prompts]]
    sampling = SamplingParams(max_tokens=args.max_tokens)
    drafts = {quant: load_model(DEFAULT_DRAFT, quiet=True, quant=quant) for quant in ("int4", "w4a8")}
    print("| target | draft | MB/token | forward ms, M = " + " / ".join(map(str, VERIFY_ROWS)) + " | " +
          " | ".join(f"{m} tok/s (identical)" for m in METHODS) + " |")
    print("|---|---|---|---|" + "---|" * len(METHODS), flush=True)
    for quant, draft_quant in (("int4", "int4"), ("w4a8", "int4"), ("w4a8", "w4a8")):
        target = load_model(DEFAULT_TARGET, quiet=True, quant=quant)
        engine = Engine(target, drafts[draft_quant])
        engine.complete(prompts[0], SamplingParams(max_tokens=8), SpecConfig("ngram,draft"))  # warm-up
        cells, plain = [], None
        for method in METHODS:
            results = [engine.complete(p, sampling, SpecConfig(method)) for p in prompts]
            decoded = sum(r.stats.new_tokens - 1 for r in results)  # the first token comes from prefill
            seconds = sum(r.stats.total_seconds - r.stats.prefill_seconds for r in results)
            plain = plain or [r.token_ids for r in results]
            same = sum(r.token_ids == ids for r, ids in zip(results, plain))
            cells.append(f"{decoded / seconds:.2f} ({same}/{len(prompts)})")
        costs = verify_cost(target.model)
        print(f"| {quant} | {draft_quant} | {streamed_bytes(target.model) / 1e6:.0f} | "
              f"{' / '.join(f'{c:.1f}' for c in costs.values())} | " + " | ".join(cells) + " |", flush=True)
        del target, engine


if __name__ == "__main__":
    main()
