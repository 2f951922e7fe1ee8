"""`specdecode advise`: which method is fastest on my model and my prompts? A measured, ranked table and the
command line of the winner."""

from __future__ import annotations

import argparse
import json

from specdecode.cli.options import add_model_args, add_spec_args, build_engine, default_draft_name, spec_from_args
from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError

DEFAULT_PROMPTS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain what a hash table is, with a short example in Python.",
]
MODEL_FLAGS = ("model", "draft_model", "dtype", "draft_dtype", "device", "quant", "draft_quant", "group_size")


def add_parser(commands) -> None:
    advise = commands.add_parser("advise", help="measure every method on your prompts and rank them")
    advise.add_argument("prompts", nargs="*", help="your prompts (default: two built-in ones)")
    advise.add_argument("--dataset", action="append", default=[],
                        help="a Spec-Bench jsonl file of prompts instead (repeatable)")
    advise.add_argument("--limit", type=int, default=8, help="questions of each dataset at most (default 8)")
    advise.add_argument("--candidates", help="methods to try, in bench's syntax (default: ngram, suffix, "
                        "ngram with 3 branches, and with a draft model draft, ngram+draft, suffix+draft, draft:k=5)")
    advise.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt at most (default 128)")
    advise.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    advise.add_argument("--json", action="store_true", help="print the ranking as one JSON object")
    add_model_args(advise)
    add_spec_args(advise)
    advise.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.bench.advise import command_line, default_candidates, prompts_as_questions, trial
    from specdecode.bench.datasets import load_questions
    from specdecode.bench.suite import parse_methods
    from specdecode.models.survey import ships_mtp

    if args.max_tokens < 1 or args.limit < 1:
        raise SpecDecodeError("--max-tokens and --limit must be >= 1")
    for prompt in args.prompts:
        if not prompt.strip():
            raise SpecDecodeError("a prompt is empty")
    questions = (load_questions(args.dataset, args.limit) if args.dataset
                 else prompts_as_questions(args.prompts or DEFAULT_PROMPTS))
    if not questions:
        raise SpecDecodeError("no prompts to try")
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    base = spec_from_args(args, default="none")  # the options only: each candidate names its method
    candidates = args.candidates or default_candidates(default_draft_name(args) is not None, ships_mtp(args.model))
    methods = parse_methods(candidates, base)  # a mistake fails now, before the models load
    engine = build_engine(args, [m.spec for m in methods], quiet=args.json)
    ranking = trial(engine, questions, methods, sampling)

    best = ranking[0]
    model_flags = model_flags_given(args)
    if args.json:
        print(json.dumps({"ranking": [{**{k: v for k, v in vars(r).items() if k != "spec"},
                                       "options": dict(r.spec.options)} for r in ranking],
                          "best": best.method, "command": command_line(best, model_flags)}))
        return 0
    print(f"{len(questions)} prompts, {sampling.max_tokens} tokens at most, "
          f"{'greedy' if sampling.greedy else f'temperature {sampling.temperature}'}; fastest first:")
    print(f"  {'method':28} {'tokens/s':>9} {'speedup':>8} {'accepted':>9} {'length':>7} {'identical':>9} "
          f"{'weights':>8}")
    for r in ranking:
        print(f"  {r.method:28} {r.tokens_per_second:9.2f} {r.speedup:7.2f}x {show(r.acceptance_rate, '9.1%')} "
              f"{show(r.mean_accepted_length, '7.2f')} {show(r.identical_rate, '9.0%')} "
              f"{r.weights_bytes / 1e9:7.2f}G")
    advice = ("plain decoding was fastest on these prompts: speculation does not pay here"
              if best.method == "none" else f"use {best.method} ({best.speedup:.2f}x plain decoding here)")
    print(f"{advice}:\n  {command_line(best, model_flags)}")
    return 0


def show(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def model_flags_given(args: argparse.Namespace) -> list[str]:
    """The model flags that differ from their defaults, for the command line the advice prints."""
    defaults = argparse.ArgumentParser()
    add_model_args(defaults)
    default = vars(defaults.parse_args([]))
    flags = []
    for name in MODEL_FLAGS:
        value = getattr(args, name)
        if value is not None and value != default[name]:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags
