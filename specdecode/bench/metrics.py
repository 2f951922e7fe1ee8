"""Spec-Bench's metric definitions, as pure functions over per-question results.

- tokens/s of a method: per question, new tokens / wall time (all turns, prefill included); then the mean
  over questions.
- speedup: mean tokens/s of the method / mean tokens/s of its plain baseline (a ratio of means).
- mean accepted length: tokens committed per target forward, bonus included, weighted by steps (1.00 plain).
- ceiling (Leviathan et al. 2022): S = (1 - a^(k+1)) / ((1 - a)(k c + 1)), a the chance an examined draft
  token is accepted (accepted / (accepted + rejections)), k the mean draft length of the steps that drafted,
  c the cost of drafting one token relative to one target forward.
"""

from __future__ import annotations

import statistics

from specdecode.bench.runner import QuestionResult
from specdecode.engine.stats import GenerationStats, combine


def completed(results: list[QuestionResult]) -> list[QuestionResult]:
    return [r for r in results if r.error is None and r.seconds > 0]


def mean_tokens_per_second(results: list[QuestionResult]) -> float:
    done = completed(results)
    return statistics.fmean(r.tokens_per_second for r in done) if done else 0.0


def speedup(results: list[QuestionResult], baseline: list[QuestionResult]) -> float:
    base = mean_tokens_per_second(baseline)
    return mean_tokens_per_second(results) / base if base else 0.0


def ceiling_speedup(alpha: float, k: float, c: float) -> float:
    """Expected speedup of a chain of k drafts accepted independently with probability alpha."""
    if k <= 0:
        return 1.0
    expected_tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected_tokens / (k * c + 1)


def draft_cost_ratio(stats: GenerationStats) -> float:
    """Seconds per drafted token over seconds per target forward, as measured."""
    if not stats.drafted_tokens or not stats.target_forwards or not stats.verify_seconds:
        return 0.0
    return (stats.draft_seconds / stats.drafted_tokens) / (stats.verify_seconds / stats.target_forwards)


def first_divergence(ids: list[list[int]], reference: list[list[int]]) -> int | None:
    """Index of the first differing token over all turns, or None when identical."""
    flat, ref = [t for turn in ids for t in turn], [t for turn in reference for t in turn]
    for position, (a, b) in enumerate(zip(flat, ref)):
        if a != b:
            return position
    return None if len(flat) == len(ref) else min(len(flat), len(ref))


def identical_rate(results: list[QuestionResult], baseline: list[QuestionResult]
                   ) -> tuple[float | None, dict[str, int]]:
    """Share of questions whose ids equal the baseline's, and the first diverging position of the others.

    None when there are no ids to compare (a text-only peer).
    """
    reference = {r.question_id: r.token_ids for r in completed(baseline) if r.token_ids is not None}
    pairs = [(r.question_id, first_divergence(r.token_ids, reference[r.question_id]))
             for r in completed(results) if r.token_ids is not None and r.question_id in reference]
    if not pairs:
        return None, {}
    divergences = {qid: pos for qid, pos in pairs if pos is not None}
    return 1 - len(divergences) / len(pairs), divergences


def summarize(runs: list[list[QuestionResult]], baseline_runs: list[list[QuestionResult]]) -> dict:
    """One method's headline numbers over its repeats (mean, and spread across repeats)."""
    per_repeat_tps = [mean_tokens_per_second(run) for run in runs]
    per_repeat_speedup = [speedup(run, base) for run, base in zip(runs, baseline_runs)]
    stats_parts = [r.stats for run in runs for r in completed(run) if r.stats is not None]
    summary = {
        "tokens_per_second": round(statistics.fmean(per_repeat_tps), 3),
        "tokens_per_second_spread": round(statistics.pstdev(per_repeat_tps), 3),
        "speedup": round(statistics.fmean(per_repeat_speedup), 3),
        "speedup_spread": round(statistics.pstdev(per_repeat_speedup), 3),
        "questions": len(completed(runs[0])),
        "errors": sum(1 for r in runs[0] if r.error is not None),
    }
    streamed = [turn for run in runs for r in completed(run) for turn in r.extra]
    for key in ("time_to_first_token", "streaming_tokens_per_second"):
        values = [turn[key] for turn in streamed if turn.get(key) is not None]
        if values:
            summary[key] = round(statistics.fmean(values), 4)
    rate, divergences = identical_rate(runs[0], baseline_runs[0])
    summary["identical_rate"] = round(rate, 4) if rate is not None else None
    summary["divergences"] = divergences
    if stats_parts:
        total = combine(stats_parts, stats_parts[0].method)
        k = total.drafted_tokens / total.drafting_steps if total.drafting_steps else 0.0
        c = draft_cost_ratio(total)
        ceiling = ceiling_speedup(total.token_acceptance, k, c) if total.drafted_tokens else 1.0
        spent = total.total_seconds or 1.0
        summary.update({
            "relaxed": total.relaxed,  # the lossy acceptance rule it ran with, None when lossless
            "mean_accepted_length": round(total.mean_accepted_length, 3),
            "acceptance_rate": round(total.acceptance_rate, 4),
            "token_acceptance": round(total.token_acceptance, 4),
            "acceptance_per_position": [round(x, 4) for x in total.acceptance_per_position],
            "mean_draft_length": round(k, 3),
            "draft_cost_ratio": round(c, 4),
            "ceiling_speedup": round(ceiling, 3),
            "ceiling_fraction": round(summary["speedup"] / ceiling, 3) if ceiling else None,
            "time_split": {"draft": round(total.draft_seconds / spent, 4),
                           "verify": round(total.verify_seconds / spent, 4),
                           "prefill": round(total.prefill_seconds / spent, 4),
                           "other": round(1 - (total.draft_seconds + total.verify_seconds
                                               + total.prefill_seconds) / spent, 4)},
            # Per-step choice (combinations with combine="best"): member -> steps, promised against realised.
            "choices": {member: record.to_dict() for member, record in total.choices.items()},
        })
    return summary


def by_category(runs: list[list[QuestionResult]], baseline_runs: list[list[QuestionResult]]) -> dict[str, dict]:
    categories = sorted({r.category for r in runs[0]})
    table = {}
    for category in categories:
        table[category] = {
            "tokens_per_second": round(statistics.fmean(
                mean_tokens_per_second(_in_category(run, category)) for run in runs), 3),
            "speedup": round(statistics.fmean(
                speedup(_in_category(run, category), _in_category(base, category))
                for run, base in zip(runs, baseline_runs)), 3),
        }
    return table


def against_fastest(method: str, singles: list[str], summaries: dict[str, dict], categories: dict[str, dict]
                    ) -> dict:
    """`method`'s mean tokens/s over the fastest of `singles`' in the same run (a ratio of speedups, since all share
    one baseline), overall and per category: how close a combination such as `auto` comes to its best member."""
    def ratio(value: float, best: float) -> float | None:
        return round(value / best, 3) if best else None

    fastest = max(singles, key=lambda name: summaries[name]["tokens_per_second"])
    per_category = {}
    for category, values in categories[method].items():
        best = max(singles, key=lambda name: categories[name][category]["tokens_per_second"])
        per_category[category] = {"fastest": best, "ratio": ratio(values["tokens_per_second"],
                                                                  categories[best][category]["tokens_per_second"])}
    return {"fastest": fastest, "ratio": ratio(summaries[method]["tokens_per_second"],
                                               summaries[fastest]["tokens_per_second"]),
            "by_category": per_category}


def _in_category(run: list[QuestionResult], category: str) -> list[QuestionResult]:
    return [r for r in run if r.category == category]
