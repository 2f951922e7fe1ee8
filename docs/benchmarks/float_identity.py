"""Float targets: the fixed-order layers (float_decoder.py) against the PyTorch layers, on the default target.

Run from the repository root (about 25 minutes on 2 cores with both dtypes):

    python docs/benchmarks/float_identity.py [--dtypes bfloat16,float32] [--prompts 6] [--max-tokens 96]

For each dtype, the 1.5B target loads once (quant none) and runs with each layer kind in turn, same process:
- plain decoding tokens/s (decode only, greedy, natural ends) on the first `--prompts` HumanEval and MT-bench
  first turns, the two kinds alternated twice so drift hits both;
- prefill tokens/s of one prompt of about 700 and one of about 2000 tokens (repeated HumanEval text);
- greedy identity of `ngram` and `draft` (the 0.5B draft in w4a8) against plain decoding of the same layers,
  on the same prompts: the share of outputs that are token for token plain decoding's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.bench.check import greedy_identity
from specdecode.bench.datasets import load_questions
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.models.loader import load_model

HUMANEVAL = "../shared/data/humaneval/humaneval_specbench_format.jsonl"
MT_BENCH = "../shared/data/mt_bench/question.jsonl"


def prompts(count: int) -> list[str]:
    return [q.turns[0] for q in load_questions([HUMANEVAL], limit=count) + load_questions([MT_BENCH], limit=count)]


def decode_speed(engine: Engine, texts: list[str], max_tokens: int) -> float:
    """Plain decoding's decode-only tokens/s over `texts`."""
    tokens = seconds = 0.0
    for text in texts:
        stats = engine.complete([{"role": "user", "content": text}], SamplingParams(max_tokens=max_tokens)).stats
        tokens += stats.new_tokens - 1
        seconds += stats.total_seconds - stats.prefill_seconds
    return tokens / seconds


def prefill_speed(engine: Engine, length: int) -> float:
    """Prefill tokens/s of one raw prompt of `length` tokens (HumanEval text repeated)."""
    text = "\n".join(q.turns[0] for q in load_questions([HUMANEVAL]))
    ids = engine.target.tokenizer.encode(text)[:length]
    started = time.perf_counter()
    engine.complete(ids, SamplingParams(max_tokens=1))
    return length / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--prompts", type=int, default=6, help="from each of HumanEval and MT-bench")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    texts = prompts(args.prompts)
    draft = load_model(DEFAULT_DRAFT, quant="auto", quiet=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(texts)} prompts, "
          f"{args.max_tokens} tokens at most\n")
    print("| dtype | layers | plain decode tok/s | prefill 700 tok/s | prefill 2000 tok/s | ngram identical "
          "| draft identical |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        target = load_model(DEFAULT_TARGET, dtype=dtype, quant="none", quiet=True)
        kinds = {"fixed-order": target.model.layers,
                 "PyTorch": nn.ModuleList(layer.unfused() for layer in target.model.layers)}
        engine = Engine(target, draft, SpecConfig("none"))
        speeds: dict[str, list[float]] = {name: [] for name in kinds}
        for _ in range(2):
            for name, layers in kinds.items():
                target.model.layers = layers
                speeds[name].append(decode_speed(engine, texts[:3], args.max_tokens))
        for name, layers in kinds.items():
            target.model.layers = layers
            prefills = [prefill_speed(engine, length) for length in (700, 2000)]
            identical = []
            for method in ("ngram", "draft"):
                cases = greedy_identity(engine, texts, SpecConfig(method), args.max_tokens)
                identical.append(f"{sum(case.identical for case in cases)}/{len(cases)}")
            print(f"| {dtype} | {name} | {statistics.mean(speeds[name]):.2f} | {prefills[0]:.1f} | "
                  f"{prefills[1]:.1f} | {identical[0]} | {identical[1]} |", flush=True)
        del engine, target, kinds
    return 0


if __name__ == "__main__":
    sys.exit(main())
