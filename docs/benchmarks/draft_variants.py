"""The draft model in other precisions, with its last layers skipped, its head reduced or its forwards reading
prompt lookup's guesses: acceptance against cost.

    python docs/benchmarks/draft_variants.py [--quants w4a8,w3a8] [--skip 0,2,4,8] [--vocab 0,48000]
        [--lookups 0,3] [--guards off,on] [--limit 10] [--max-tokens 128] --out DIR

Default pair, w4a8 target, greedy, natural ends (the chat template's end of turn): the first turn of 10 HumanEval
prompts and of MT-bench's first question per category (../shared/data). A variant is the draft model loaded in one
precision (--draft-quant's choices), running its first L - N layers, then its own final norm and output head, over
its whole vocabulary or draft_vocab's reduced head, each forward reading draft_lookup guesses, with the speed guard
off (every step drafts) or on (as by default); the target verifies as always, so the output cannot change (checked
against plain decoding here). Measured in one run, in turns prompt by prompt: decoding tokens/s against
plain decoding's, acceptance (and by draft position), the drafter's seconds per drafted token as a share of a
plain step, and drafted tokens per draft forward (catch-ups counted as forwards).
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


def added(totals: list[int], counts: list[int]) -> list[int]:
    """Per-position counts added to running totals, the shorter list padded with zeros."""
    width = max(len(totals), len(counts))
    return [a + b for a, b in zip(totals + [0] * (width - len(totals)), counts + [0] * (width - len(counts)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quants", default="w4a8", help="the draft's precisions, comma-separated")
    parser.add_argument("--skip", default="0", help="layers to skip, comma-separated")
    parser.add_argument("--vocab", default="0", help="draft_vocab sizes, comma-separated (0: the whole head)")
    parser.add_argument("--lookups", default="3", help="draft_lookup values, comma-separated (0: off)")
    parser.add_argument("--guards", default="off", help="the speed guard, comma-separated: off (every step drafts), "
                        "on (as by default)")
    parser.add_argument("--limit", type=int, default=10, help="HumanEval prompts")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    target = load_model(DEFAULT_TARGET, quiet=True)
    drafts = {quant: load_model(DEFAULT_DRAFT, quant=quant, quiet=True) for quant in args.quants.split(",")}
    forwards = [0]  # draft forwards so far, of every variant (catch-ups included)
    for draft in drafts.values():
        draft.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    questions = load_questions([HUMANEVAL], limit=args.limit) + load_questions([MT_BENCH], per_category=1)
    prompts = [target.tokenizer.encode_chat([{"role": "user", "content": q.turns[0]}]) for q in questions]
    # (precision, layers skipped, draft_vocab, draft_lookup, guard) -> its engine and the spec it drafts with
    variants = {(quant, int(skip), int(vocab), int(lookup), guard): (Engine(target, shallower(draft, int(skip))),
                SpecConfig("draft", guard=guard == "on",
                           options={"draft_vocab": int(vocab), "draft_lookup": int(lookup)}))
                for quant, draft in drafts.items() for skip in args.skip.split(",") for vocab in args.vocab.split(",")
                for lookup in args.lookups.split(",") for guard in args.guards.split(",")}
    plain_engine = next(iter(variants.values()))[0]
    runs = {variant: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "draft_seconds": 0.0,
                      "identical": 0, "drafted_per_position": [], "accepted_per_position": [], "draft_forwards": 0}
            for variant in variants}
    plain = {"tokens": 0, "seconds": 0.0}
    step_costs = []
    for index, prompt in enumerate(prompts):
        reference, seconds, _ = decode(plain_engine, prompt, SpecConfig("none"), args.max_tokens)
        plain["tokens"] += len(reference) - 1
        plain["seconds"] += seconds
        step_costs.append(seconds / max(1, len(reference) - 1))
        for variant, (engine, spec) in variants.items():
            before = forwards[0]
            tokens, seconds, stats = decode(engine, prompt, spec, args.max_tokens)
            run = runs[variant]
            run["draft_forwards"] += forwards[0] - before
            run["tokens"] += len(tokens) - 1
            run["seconds"] += seconds
            run["drafted"] += stats.drafted_tokens
            run["accepted"] += stats.accepted_tokens
            run["draft_seconds"] += stats.draft_seconds
            run["identical"] += tokens == reference
            for key in ("drafted_per_position", "accepted_per_position"):
                run[key] = added(run[key], getattr(stats, key))
        print(f"prompt {index + 1}/{len(prompts)} done", flush=True)
    plain_speed = plain["tokens"] / plain["seconds"]
    step = statistics.median(step_costs)
    layers = len(next(iter(drafts.values())).model.layers)
    lines = [(f"# The draft model's variants: {DEFAULT_DRAFT} ({layers} layers) for {DEFAULT_TARGET} (w4a8), "
             f"{len(prompts)} prompts, {args.max_tokens} tokens at most, greedy"), "",
             f"plain decoding: {plain_speed:.1f} tokens/s", "",
             ("| draft | layers run | head rows | lookup guesses | speed guard | tokens/s | x plain | acceptance | "
              "by position | drafter time per drafted token / plain step | drafted tokens per draft forward | "
              "identical |"),
             "|---|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for (quant, skip, vocab, lookup, guard), run in runs.items():
        speed = run["tokens"] / run["seconds"]
        cost = run["draft_seconds"] / max(1, run["drafted"]) / step
        by_position = " / ".join(f"{accepted / drafted:.2f}" for accepted, drafted
                                 in zip(run["accepted_per_position"], run["drafted_per_position"]) if drafted)
        lines.append(f"| {quant} | {layers - skip} | {vocab or 'all'} | {lookup} | {guard} | {speed:.1f} | "
                     f"{speed / plain_speed:.2f} | {run['accepted'] / max(1, run['drafted']):.1%} | {by_position} | "
                     f"{cost:.2f} | {run['drafted'] / max(1, run['draft_forwards']):.2f} | "
                     f"{run['identical']}/{len(prompts)} |")
    data = {"plain": plain, "layers": layers,
            "runs": {f"{quant} skip {skip} vocab {vocab} lookup {lookup} guard {guard}": run
                     for (quant, skip, vocab, lookup, guard), run in runs.items()}}
    write_report(args.out, "draft_variants", data, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
