"""What a benchmark leaves behind: a terminal table, results.json, report.md and two plots."""

from __future__ import annotations

import json
import platform
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import torch

COLUMNS = [("method", "method", "{}"), ("tokens_per_second", "tok/s", "{:.2f}"), ("speedup", "speedup", "{:.2f}x"),
           ("mean_accepted_length", "acc. len", "{:.2f}"), ("acceptance_rate", "accept", "{:.1%}"),
           ("ceiling_speedup", "ceiling", "{:.2f}x"), ("identical_rate", "identical", "{:.0%}")]


def table(summaries: dict[str, dict]) -> str:
    rows = [[title for _, title, _ in COLUMNS]]
    for name, summary in summaries.items():
        row = []
        for key, _, fmt in COLUMNS:
            value = method_label(name, summary) if key == "method" else summary.get(key)
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def method_label(name: str, summary: dict) -> str:
    """The method's name, marked where it ran with relaxed (lossy) acceptance."""
    return f"{name} (lossy: {summary['relaxed']})" if summary.get("relaxed") else name


def environment() -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "command": "specdecode " + " ".join(shlex.quote(a) for a in sys.argv[1:])}


def write_outputs(out: Path, summaries: dict[str, dict], categories: dict[str, dict], raw: dict, setup: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    results = {"setup": setup, "environment": env, "summary": summaries, "by_category": categories,
               "questions": {name: [[_question_record(q) for q in run] for run in runs] for name, runs in raw.items()}}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot_speedup(out / "speedup_by_category.png", summaries, categories)
    plot_acceptance(out / "acceptance_by_position.png", summaries)
    (out / "report.md").write_text(markdown(summaries, categories, setup, env))


def _question_record(result) -> dict:
    record = asdict(result)
    record["stats"] = result.stats.to_dict() if result.stats is not None else None
    record["tokens_per_second"] = round(result.tokens_per_second, 3)
    return record


def markdown(summaries: dict[str, dict], categories: dict[str, dict], setup: dict, env: dict) -> str:
    lines = ["# Benchmark report", "", f"Command: `{env['command']}`", "",
             "| setting | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in {**setup, **{k: v for k, v in env.items() if k != "command"}}.items()]
    lines += ["", "## Methods", "", "| " + " | ".join(t for _, t, _ in COLUMNS) + " | time split (draft / verify "
              "/ prefill / other) |", "|" + "---|" * (len(COLUMNS) + 1)]
    for name, s in summaries.items():
        cells = [method_label(name, s) if key == "method" else ("-" if s.get(key) is None else fmt.format(s[key]))
                 for key, _, fmt in COLUMNS]
        split = s.get("time_split")
        cells.append(" / ".join(f"{split[p]:.0%}" for p in ("draft", "verify", "prefill", "other")) if split else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## By category (tokens/s, speedup over the family's plain decoding)", "",
              "| method | " + " | ".join(categories[next(iter(categories))]) + " |",
              "|---|" + "---|" * len(categories[next(iter(categories))])]
    for name, per_category in categories.items():
        lines.append(f"| {name} | " + " | ".join(f"{v['tokens_per_second']:.2f} ({v['speedup']:.2f}x)"
                                                  for v in per_category.values()) + " |")
    lines += against_fastest_lines(summaries)
    lines += divergence_lines(summaries)
    lines += choice_lines(summaries)
    lines += ["", "## Definitions (Spec-Bench)", "",
              "- tokens/s: per question, new tokens over wall time (all turns, prefill included; with a fresh "
              "process per answer, the requests' own time, load and warm-up excluded), then the mean.",
              "- speedup: mean tokens/s of the method over mean tokens/s of plain decoding of the same family "
              "(ours: `none`; transformers: `hf:plain`; an OpenAI-compatible server: our `none`), measured in the "
              "same run on the same prompts.",
              "- acc. len: mean accepted length, tokens per target forward including the bonus token (1.00 plain).",
              "- accept: accepted / drafted tokens. ceiling: (1 - a^(k+1)) / ((1 - a)(k c + 1)) (Leviathan et al. "
              "2022) with a the chance an examined draft token is accepted (accepted / (accepted + rejections)), "
              "k the mean draft length of the steps that drafted and c the measured draft cost ratio.",
              "- identical: share of questions whose token ids equal plain decoding's (greedy, or sampled at a seed by "
              "the coupled rule).", "",
              "![speedup](speedup_by_category.png)", "", "![acceptance](acceptance_by_position.png)", ""]
    return "\n".join(lines)


def choice_lines(summaries: dict[str, dict]) -> list[str]:
    """Per-step choice, per combination and member chosen: its steps and what it promised against what it gave."""
    rows = [f"| {name} | {member} | {c['steps']} | {_cell(c['promised_tokens_per_step'], '{:.2f}')} | "
            f"{_cell(c['realised_tokens_per_step'], '{:.2f}')} | {_cell(c['promised_tokens_per_second'], '{:.1f}')} | "
            f"{_cell(c['realised_tokens_per_second'], '{:.1f}')} | {_cell(c.get('mean_draft_depth'), '{:.2f}')} |"
            for name, summary in summaries.items() for member, c in (summary.get("choices") or {}).items()]
    if not rows:
        return []
    return ["", "## Per-step choice: promised against realised", "",
            "| method | chosen | steps | tokens/step promised | realised | tokens/s promised | realised | draft depth |",
            "|---|---|---|---|---|---|---|---|", *rows]


def against_fastest_lines(summaries: dict[str, dict]) -> list[str]:
    """`auto` over the fastest single method of the run, overall and per category (metrics.against_fastest)."""
    rows = []
    for name, summary in summaries.items():
        against = summary.get("against_fastest_single")
        if against:
            cells = [f"{_cell(against['ratio'], '{:.3f}')} ({against['fastest']})"]
            cells += [f"{_cell(c['ratio'], '{:.3f}')} ({c['fastest']})" for c in against["by_category"].values()]
            rows.append((name, list(against["by_category"]), cells))
    if not rows:
        return []
    categories = rows[0][1]
    return ["", "## Against the fastest single method (tokens/s over its tokens/s; which one it was)", "",
            "| method | overall | " + " | ".join(categories) + " |", "|---|" + "---|" * (len(categories) + 1),
            *(f"| {name} | " + " | ".join(cells) + " |" for name, _, cells in rows)]


def _cell(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def divergence_lines(summaries: dict[str, dict]) -> list[str]:
    """Each output that differs from its family's plain decoding: where, and how close the target's top two were."""
    rows = []
    for name, summary in summaries.items():
        for qid, where in (summary.get("divergences") or {}).items():
            if isinstance(where, dict):  # ours: the target's top-2 logit gap at the diverging token is known
                gap = f"{where['top2_gap']:.3f}" if where.get("top2_gap") is not None else "-"
                tie = "yes" if where.get("near_tie") else "no"
                rows.append(f"| {name} | {qid} | {where['position']} | {gap} | {tie} |")
            else:
                rows.append(f"| {name} | {qid} | {where} | - | - |")
    if not rows:
        return []
    return ["", "## Divergences from plain decoding (greedy, or coupled at a seed)", "",
            "| method | question | first differing token | target's top-2 gap there | near-tie |",
            "|---|---|---|---|---|", *rows]


def plot_speedup(path: Path, summaries: dict[str, dict], categories: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(categories)
    groups = list(categories[names[0]]) + ["overall"]
    fig, ax = plt.subplots(figsize=(min(14, max(7, 0.25 * len(groups) * len(names))), 5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [categories[name][g]["speedup"] for g in groups[:-1]] + [summaries[name]["speedup"]]
        xs = [g + i * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=name, color=_color(i))
        ceiling = summaries[name].get("ceiling_speedup")
        if ceiling and summaries[name].get("acceptance_rate") is not None and name != "none":
            ax.plot([xs[-1] - width / 2, xs[-1] + width / 2], [ceiling, ceiling], color="black", linewidth=2)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    ax.set_ylabel("speedup over own plain decoding (x)")
    ax.set_title("Speedup by category (black bar: theoretical ceiling from measured acceptance)", fontsize=10)
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.08), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(path: Path, summaries: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, summary) in enumerate(summaries.items()):
        rates = summary.get("acceptance_per_position") or []
        if rates:
            ax.plot(range(1, len(rates) + 1), [100 * r for r in rates], marker="o", label=name, color=_color(i))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (%)")
    ax.set_ylim(0, 105)
    ax.set_title("Acceptance by draft position (accepted / drafted at that position)", fontsize=10)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _color(index: int):
    """The same method keeps the same colour in every plot."""
    import matplotlib

    return matplotlib.colormaps["tab10"](index % 10)
