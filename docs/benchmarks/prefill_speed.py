"""Prefill tokens/s of the default target at several prompt lengths (one process, after a warm-up).

Run from the repository root (about 3 minutes on 2 cores in w4a8):

    python docs/benchmarks/prefill_speed.py [--quant auto] [--dtype auto] [--lengths 512,2000,8000]
        [--llama-bench PATH]

The prompt is HumanEval and MT-bench text run together, cut to each length, raw (no chat template); one
token is generated, so the time is the prefill's. With --llama-bench (a llama-bench binary; how to build it:
plain_vs_llamacpp.py's docstring), llama.cpp's ppN on the same GGUF file with 2 threads runs before ours at
each length, in the same process tree, one repetition each (llama-bench's prompt is random tokens; prefill
cost does not depend on which tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.bench.datasets import load_questions
from specdecode.models.formats.default_models import DEFAULT_MODELS, DEFAULT_TARGET, assemble
from specdecode.models.loader import load_model

DATASETS = ["../shared/data/humaneval/humaneval_specbench_format.jsonl", "../shared/data/mt_bench/question.jsonl"]


def llama_bench_prefill(binary: Path, gguf: Path, length: int) -> float:
    """llama.cpp's ppN tokens/s: llama-bench -p N -n 0, 2 threads, one repetition, its JSON report."""
    command = [str(binary), "-m", str(gguf), "-p", str(length), "-n", "0", "-t", "2", "-r", "1", "-o", "json"]
    report = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(report)[0]["avg_ts"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quant", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--lengths", default="512,2000,8000")
    parser.add_argument("--llama-bench", type=Path, help="a llama-bench binary: also run llama.cpp's ppN")
    args = parser.parse_args()
    target = load_model(DEFAULT_TARGET, dtype=args.dtype, quant=args.quant, quiet=True)
    engine = Engine(target, None, SpecConfig("none"))
    ids = target.tokenizer.encode("\n".join(q.turns[0] for q in load_questions(DATASETS)))
    engine.complete(ids[:64], SamplingParams(max_tokens=1))  # warm-up
    print(f"default target, --quant {target.quant}, {target.model.dtype}")
    gguf = assemble(DEFAULT_MODELS[DEFAULT_TARGET], quiet=True)
    for length in (int(part) for part in args.lengths.split(",")):
        if len(ids) < length:
            raise SystemExit(f"the prompt text has {len(ids)} tokens, fewer than {length}")
        theirs = f", llama.cpp pp{length}: {llama_bench_prefill(args.llama_bench, gguf, length):.1f}" \
            if args.llama_bench else ""
        started = time.perf_counter()
        engine.complete(ids[:length], SamplingParams(max_tokens=1))
        print(f"prefill {length} tokens: {length / (time.perf_counter() - started):.1f} tokens/s{theirs}",
              flush=True)


if __name__ == "__main__":
    main()
