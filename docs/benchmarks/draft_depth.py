"""The draft model with its last layers skipped (its final norm and head kept): acceptance against cost, by depth.

    python docs/benchmarks/draft_depth.py [--skip 0,2,4,8] [--limit 10] [--max-tokens 128] --out DIR

Default pair, w4a8, greedy, natural ends (the chat template's end of turn), the guard off so that every step
drafts: the first turn of 10 HumanEval prompts and of MT-bench's first question per category (../shared/data).
For each depth the draft model runs its first L - N layers, then its own final norm and output head; the target
verifies as always, so the output cannot change (checked against plain decoding here). Measured in one run, in
turns prompt by prompt: decoding tokens/s against plain decoding's, acceptance, and the drafter's seconds per
drafted token as a share of a plain step. A depth is worth an option only if it is faster than the whole draft.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench_files import write_report
from torch import nn

from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.bench.datasets import load_questions
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET

HUMANEVAL = "../shared/data/humaneval/humaneval_specbench_format.jsonl"
MT_BENCH = "../shared/data/mt_bench/question.jsonl"


def shallower(loaded, skip: int):
    """The draft model with its last `skip` layers left out (weights shared; its cache still has room for them)."""
    if not skip:
        return loaded
    model = copy.copy(loaded.model)
    model._modules = dict(loaded.model._modules)  # a module of its own, its submodules shared
    model.layers = nn.ModuleList(list(loaded.model.layers)[:-skip])
    return replace(loaded, model=model)


def decode(engine: Engine, prompt: list[int], spec: SpecConfig, max_tokens: int) -> tuple[list[int], float, object]:
    """(tokens, decoding seconds after the prefill, stats) of one greedy request."""
    request = engine.begin(prompt, SamplingParams(max_tokens=max_tokens), spec, reuse_prefix=False)
    engine.prefill(request)
    began = time.perf_counter()
    while request.finish_reason is None:
        engine.step(request)
    seconds = time.perf_counter() - began
    engine.finish(request)
    return request.tokens[request.prompt_len:], seconds, request.stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip", default="0,2,4,8", help="layers to skip, comma-separated")
    parser.add_argument("--limit", type=int, default=10, help="HumanEval prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    target = load_model(DEFAULT_TARGET, quiet=True)
    draft = load_model(DEFAULT_DRAFT, quant="w4a8", quiet=True)
    questions = load_questions([HUMANEVAL], limit=args.limit) + load_questions([MT_BENCH], per_category=1)
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
    skips = [int(n) for n in args.skip.split(",")]
    engines = {n: Engine(target, shallower(draft, n)) for n in skips}
    plain_engine = engines[skips[0]]
    spec = SpecConfig("draft", guard=False)
    runs = {n: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "draft_seconds": 0.0, "steps": 0,
                "identical": 0} for n in skips}
    plain = {"tokens": 0, "seconds": 0.0}
    step_costs = []
    for index, prompt in enumerate(prompts):
        reference, seconds, _ = decode(plain_engine, prompt, SpecConfig("none"), args.max_tokens)
        plain["tokens"] += len(reference) - 1
        plain["seconds"] += seconds
        step_costs.append(seconds / max(1, len(reference) - 1))
        for n in skips:
            tokens, seconds, stats = decode(engines[n], prompt, spec, args.max_tokens)
            run = runs[n]
            run["tokens"] += len(tokens) - 1
            run["seconds"] += seconds
            run["drafted"] += stats.drafted_tokens
            run["accepted"] += stats.accepted_tokens
            run["draft_seconds"] += stats.draft_seconds
            run["identical"] += tokens == reference
        print(f"prompt {index + 1}/{len(prompts)} done", flush=True)
    plain_speed = plain["tokens"] / plain["seconds"]
    step = statistics.median(step_costs)
    layers = len(draft.model.layers)
    lines = [(f"# The draft model by depth: {DEFAULT_DRAFT} ({layers} layers, w4a8) for {DEFAULT_TARGET} (w4a8), "
             f"{len(prompts)} prompts, {args.max_tokens} tokens at most, greedy"), "",
             f"plain decoding: {plain_speed:.1f} tokens/s", "",
             ("| layers run | tokens/s | x plain | acceptance | drafter time per drafted token / plain step | "
             "identical |"), "|---:|---:|---:|---:|---:|---:|"]
    for n, run in runs.items():
        speed = run["tokens"] / run["seconds"]
        cost = run["draft_seconds"] / max(1, run["drafted"]) / step
        lines.append(f"| {layers - n} | {speed:.1f} | {speed / plain_speed:.2f} | "
                     f"{run['accepted'] / max(1, run['drafted']):.1%} | {cost:.2f} | "
                     f"{run['identical']}/{len(prompts)} |")
    write_report(args.out, "draft_depth", {"plain": plain, "runs": runs, "layers": layers}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
