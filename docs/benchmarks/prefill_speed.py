"""Prefill tokens/s of the default target at several prompt lengths (one process, after a warm-up).

Run from the repository root (about 3 minutes on 2 cores in w4a8):

    python docs/benchmarks/prefill_speed.py [--quant auto] [--dtype auto] [--lengths 512,2000,8000]

The prompt is HumanEval and MT-bench text run together, cut to each length, raw (no chat template); one
token is generated, so the time is the prefill's.
"""

from __future__ import annotations

import argparse
import time

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.bench.datasets import load_questions
from specdecode.models.formats.default_models import DEFAULT_TARGET
from specdecode.models.loader import load_model

DATASETS = ["../shared/data/humaneval/humaneval_specbench_format.jsonl", "../shared/data/mt_bench/question.jsonl"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--lengths", default="512,2000,8000")
    args = parser.parse_args()
    target = load_model(DEFAULT_TARGET, dtype=args.dtype, quant=args.quant, quiet=True)
    engine = Engine(target, None, SpecConfig("none"))
    ids = target.tokenizer.encode("\n".join(q.turns[0] for q in load_questions(DATASETS)))
    engine.complete(ids[:64], SamplingParams(max_tokens=1))  # warm-up
    print(f"default target, --quant {target.quant}, {target.model.dtype}")
    for length in (int(part) for part in args.lengths.split(",")):
        started = time.perf_counter()
        engine.complete(ids[:length], SamplingParams(max_tokens=1))
        print(f"prefill {length} tokens: {length / (time.perf_counter() - started):.1f} tokens/s", flush=True)


if __name__ == "__main__":
    main()
