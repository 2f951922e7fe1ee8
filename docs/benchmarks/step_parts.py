"""Where a drafting step's time goes, against a plain step's, on the default pair: the draft model's forwards, the
target's verify forward, and the engine's own time around them; and the verify forward alone by rows.

    python docs/benchmarks/step_parts.py [--prompts 8] [--max-tokens 256] [--rounds 2] --out DIR

Each prompt (the first turns of MT-bench's questions, two per category, from ../shared/data) is answered by plain
decoding and by `draft` in turn, greedy, to its natural end; every answer is compared with plain decoding's. Per
step, from each request's stats: plain = the generation phase over its target forwards; for `draft`, the drafting
seconds, the verify seconds and what is left (the engine: acceptance, commits, the guard, bookkeeping), over its
steps, and the tokens a step commits. Then the target's forward over 1-8 new rows after a 200-token context,
timed alone (median of --rounds x 5). The ratio is committed tokens per step x plain step / drafting step; the
table says what it would be with each part's time gone, which names the part that bounds it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_files import write_report

from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "mt_bench" / "question.jsonl"


def first_turns(count: int) -> list[str]:
    """The first turns of `count` MT-bench questions, as evenly over its categories as count allows."""
    questions = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    by_category: dict[str, list[str]] = {}
    for question in questions:
        by_category.setdefault(question["category"], []).append(question["turns"][0])
    chosen, index = [], 0
    while len(chosen) < count:
        for turns in by_category.values():
            if index < len(turns) and len(chosen) < count:
                chosen.append(turns[index])
        index += 1
    return chosen


def step_parts(result) -> dict:
    stats = result.stats
    steps = max(1, stats.target_forwards)
    generation = stats.total_seconds - stats.prefill_seconds
    return {"steps": steps, "tokens": len(result.token_ids), "generation": generation,
            "draft": stats.draft_seconds, "verify": stats.verify_seconds,
            "engine": generation - stats.draft_seconds - stats.verify_seconds,
            "drafted": stats.drafted_tokens, "accepted": stats.accepted_tokens,
            "drafting_steps": stats.drafting_steps}


def verify_by_rows(model, rounds: int, context: int = 200) -> dict[int, float]:
    """rows -> median seconds of the target's forward over that many new tokens after `context` cached ones."""
    cache = model.new_cache(context + 8)
    samples: dict[int, list[float]] = {rows: [] for rows in range(1, 9)}
    with torch.inference_mode():
        ids = torch.arange(context).unsqueeze(0)  # [1, C]
        model(ids % 1000 + 100, ids, cache)
        for round_ in range(rounds * 5 + 1):
            for rows, times in samples.items():
                tokens = torch.full((1, rows), 1000)  # [1, M]
                positions = torch.arange(context, context + rows).unsqueeze(0)  # [1, M]
                began = time.perf_counter()
                model(tokens, positions, cache)
                if round_:  # the first round warms every shape up
                    times.append(time.perf_counter() - began)
                cache.truncate(context)
    return {rows: statistics.median(times) for rows, times in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    target = load_model(DEFAULT_TARGET, quant="w4a8", quiet=True)
    draft = load_model(DEFAULT_DRAFT, quant="w4a8", quiet=True)
    engine = Engine(target, draft)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    runs: dict[str, list[dict]] = {"plain": [], "draft": []}
    identical = True
    for _ in range(args.rounds):
        for prompt in first_turns(args.prompts):
            messages = [{"role": "user", "content": prompt}]
            plain = engine.complete(messages, sampling, SpecConfig("none"))
            drafted = engine.complete(messages, sampling, SpecConfig("draft"))
            identical &= plain.token_ids == drafted.token_ids
            runs["plain"].append(step_parts(plain))
            runs["draft"].append(step_parts(drafted))
    rows = verify_by_rows(target.model, args.rounds)

    def total(name: str, key: str) -> float:
        return sum(run[key] for run in runs[name])

    plain_step = total("plain", "generation") / total("plain", "steps")
    steps = total("draft", "steps")
    parts = {part: total("draft", part) / steps for part in ("draft", "verify", "engine")}
    draft_step = sum(parts.values())
    per_step = total("draft", "tokens") / steps  # committed tokens a drafting run's step gives
    ratio = per_step * plain_step / draft_step
    drafted_per_step = total("draft", "drafted") / max(1, total("draft", "drafting_steps"))
    without = {part: per_step * plain_step / (draft_step - seconds) for part, seconds in parts.items()}
    verify_one = rows[1]
    verify_as_one = per_step * plain_step / (draft_step - parts["verify"] + verify_one)
    data = {"target": DEFAULT_TARGET, "draft": DEFAULT_DRAFT, "quant": "w4a8", "threads": torch.get_num_threads(),
            "prompts": args.prompts, "rounds": args.rounds, "max_tokens": args.max_tokens, "identical": identical,
            "plain_step": plain_step, "parts": parts, "tokens_per_step": per_step, "ratio": ratio,
            "drafted_per_drafting_step": drafted_per_step,
            "acceptance": total("draft", "accepted") / max(1, total("draft", "drafted")),
            "ratio_without": without, "ratio_with_verify_as_one_row": verify_as_one,
            "verify_by_rows": rows, "runs": runs}
    lines = [(f"# A drafting step's parts: {DEFAULT_TARGET} with {DEFAULT_DRAFT}, both w4a8, "
              f"{torch.get_num_threads()} threads"), "",
             (f"{args.prompts} MT-bench first turns x {args.rounds} rounds, greedy, natural ends up to "
              f"{args.max_tokens} tokens; output identical to plain decoding: {'yes' if identical else 'NO'}."), "",
             "| per step | ms | share of a drafting step |", "|---|---:|---:|",
             f"| plain step (one target forward and the engine) | {plain_step * 1000:.1f} | |",
             *[f"| draft: {part} | {seconds * 1000:.1f} | {seconds / draft_step:.0%} |"
               for part, seconds in parts.items()],
             f"| draft: whole step | {draft_step * 1000:.1f} | 100% |", "",
             (f"A drafting run's step commits {per_step:.2f} tokens (drafts of {drafted_per_step:.2f} tokens where it "
              f"drafts, {data['acceptance']:.0%} accepted): {ratio:.2f}x plain. Without the draft forwards "
              f"{without['draft']:.2f}x, with verification as cheap as one token {verify_as_one:.2f}x, without the "
              f"engine's own time {without['engine']:.2f}x."), "",
             "| verify rows | ms | x one row |", "|---:|---:|---:|",
             *[f"| {m} | {s * 1000:.1f} | {s / verify_one:.2f} |" for m, s in rows.items()]]
    write_report(args.out, "step-parts", data, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
