"""How well a suffix proposal's depth predicts its acceptance, and how per-step choice's estimates predict it,
over a bench run's plain answers (no model forward: the answers are the plain pass's token ids).

    python docs/benchmarks/lookup_depth.py docs/benchmarks/2026-12-07-long-lived/6c09399-36-prompts/results.json

At every position of every plain answer (each turn's prompt rebuilt with the target's chat template), suffix
proposes from the request alone (a fresh process: no response cache) up to 8 tokens; the answer's next tokens say
how many of them a greedy target accepts. Prints by proposal depth: how many proposals, the tokens accepted, the
share whose first token is accepted, and what StepChooser predicted before each verdict, pooled over depths (as
before #62's eighth session) and by depth (StepChooser.expected_lookup), once with a new chooser per answer (a
process's first request) and once with one chooser for all (a long-lived process); every position counts as a
verified step, so this measures the estimates, not the choice.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode import load_model
from specdecode.drafters.step_choice import StepChooser
from specdecode.drafters.suffix import SuffixDrafter, SuffixOptions
from specdecode.models.formats.default_models import DEFAULT_TARGET

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
DATASETS = [DATA / "mt_bench" / "question.jsonl", DATA / "humaneval" / "humaneval_specbench_format.jsonl"]
BUDGET = 8  # tokens a proposal may hold
MEMBER = "suffix"


def proposals(results: dict) -> list[tuple[int, int, bool]]:
    """(depth, tokens accepted, new answer) for every position of every plain answer where suffix proposes."""
    questions = {str(q["question_id"]): q for path in DATASETS for q in map(json.loads, path.read_text().splitlines())}
    tokenizer = load_model(DEFAULT_TARGET, "bfloat16", quiet=True, quant="none").tokenizer
    suffix = SuffixDrafter(SuffixOptions(suffix_cache_requests=0))
    rows = []
    for answer in results["questions"]["none"][0]:
        messages: list[dict] = []
        for turn, ids in zip(questions[str(answer["question_id"])]["turns"], answer["token_ids"]):
            messages.append({"role": "user", "content": turn})
            prompt = tokenizer.encode_chat(messages)  # [P] token ids
            for position in range(len(ids)):
                drafted = suffix.candidate(prompt + ids[:position], BUDGET).tokens
                if drafted:
                    actual = ids[position:position + len(drafted)]
                    accepted = next((i for i, (a, b) in enumerate(zip(drafted, actual)) if a != b), len(actual))
                    rows.append((len(drafted), accepted, position == 0))
            messages.append({"role": "assistant", "content": tokenizer.decode(ids)})
    return rows


def predictions(rows: list[tuple[int, int, bool]], per_answer: bool) -> dict[int, list[float]]:
    """depth -> [pooled predicted, by-depth predicted, accepted, count] summed, and absolute errors under 0."""
    table: dict[int, list[float]] = {0: [0.0, 0.0, 0.0, 0.0]}
    chooser = StepChooser([MEMBER])
    for depth, accepted, new_answer in rows:
        if per_answer and new_answer:
            chooser = StepChooser([MEMBER])
        pooled = chooser.members[MEMBER].expected_accepted(depth, chooser.prior(MEMBER))
        by_depth = chooser.expected_lookup(MEMBER, depth, depth)[0] - 1
        sums = table.setdefault(depth, [0.0, 0.0, 0.0, 0.0])
        for i, value in enumerate((pooled, by_depth, accepted, 1)):
            sums[i] += value
        errors = table[0]
        errors[0] += abs(pooled - accepted)
        errors[1] += abs(by_depth - accepted)
        errors[3] += 1
        chooser.record_verdict(MEMBER, depth, accepted, depth, 0.1)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a bench results.json whose plain answers to read")
    rows = proposals(json.loads(parser.parse_args().results.read_text()))
    first = {depth: [0, 0] for depth, _, _ in rows}
    for depth, accepted, _ in rows:
        first[depth][0] += 1
        first[depth][1] += accepted > 0
    for per_answer in (True, False):
        table = predictions(rows, per_answer)
        errors = table.pop(0)
        print(f"{'a new chooser per answer' if per_answer else 'one chooser for all answers'}: mean absolute "
              f"error pooled {errors[0] / errors[3]:.2f}, by depth {errors[1] / errors[3]:.2f} tokens")
        print("  depth  proposals  accepted  first accepted  pooled predicted  by-depth predicted")
        for depth in sorted(table):
            pooled, by_depth, accepted, count = table[depth]
            print(f"  {depth:5d}  {int(count):9d}  {accepted / count:8.2f}  {first[depth][1] / count:14.2f}  "
                  f"{pooled / count:16.2f}  {by_depth / count:18.2f}")


if __name__ == "__main__":
    main()
