"""The child of `specdecode bench --fresh-process` (bench/fresh_process.py): one answer in a new process.

It reads one request as JSON on standard input, loads and warms up as `specdecode generate` does (build_engine),
answers, and prints one JSON line: the text, token ids, the stats' fields, the request's own seconds and the load's.
An error a user can cause (a model that will not load) ends in one line on stderr and exit status 1, which the
bench records against that question."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from time import perf_counter

from specdecode.cli.options import build_engine
from specdecode.config import SamplingParams, SpecConfig
from specdecode.errors import SpecDecodeError

COMMAND = (sys.executable, "-m", "specdecode.cli.bench_answer")


def model_arguments(args: argparse.Namespace) -> dict:
    """The command line's settings a child needs to load the same models: every plain value (not the handler)."""
    plain = (str, int, float, bool, type(None), list, tuple)
    return {name: value for name, value in vars(args).items() if isinstance(value, plain)}


def answer(request: dict) -> dict:
    began = perf_counter()
    spec = SpecConfig(**request["spec"])
    sampling = SamplingParams(**request["sampling"])
    engine = build_engine(argparse.Namespace(**request["arguments"]), [spec], quiet=True)
    loaded = perf_counter()
    outcome = engine.complete(request["messages"], sampling, spec)
    return {"text": outcome.text, "token_ids": outcome.token_ids, "stats": asdict(outcome.stats),
            "seconds": perf_counter() - loaded, "load_seconds": round(loaded - began, 3)}


def main() -> int:
    try:
        print(json.dumps(answer(json.load(sys.stdin))))
    except SpecDecodeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
