"""Write a repeated-workload prompt set (Spec-Bench JSONL) from Python's standard library, no public benchmark.

Suffix decoding is built for work that repeats itself: an agent rereading and rewriting its own output, several
edits of the same code. Two categories, over small functions taken from the standard library's source:

- `edit-twice`: one conversation, "add type hints" then "now add a docstring too" (turn 2 rewrites turn 1's
  answer, which is in the context);
- `same-code`: two separate requests over the same function with different edits (the second can draft from
  the first's response only through a cache that outlives a request).

    python docs/benchmarks/repeated_workload.py --out /tmp/repeated.jsonl --functions 6
    specdecode bench --dataset /tmp/repeated.jsonl --methods ngram,suffix --quant w4a8
"""

from __future__ import annotations

import argparse
import calendar
import fnmatch
import inspect
import json
import shlex
import textwrap
from pathlib import Path

MODULES = [textwrap, shlex, fnmatch, calendar]


def small_functions(count: int, min_lines: int = 8, max_lines: int = 30) -> list[tuple[str, str]]:
    """(qualified name, source) of the first `count` module-level functions of a pleasant size."""
    found = []
    for module in MODULES:
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ != module.__name__ or name.startswith("_"):
                continue
            source = textwrap.dedent(inspect.getsource(function))
            if min_lines <= source.count("\n") <= max_lines:
                found.append((f"{module.__name__}.{name}", source))
    return found[:count]


def questions(functions: list[tuple[str, str]]) -> list[dict]:
    rows = []
    for index, (name, source) in enumerate(functions):
        code = f"```python\n{source}```"
        rows.append({"question_id": f"edit-twice-{index}", "category": "edit-twice",
                     "turns": [f"Add type hints to this Python function ({name}) and return the whole function.\n\n"
                               f"{code}", "Now also add a docstring, and return the whole function again."]})
        for edit in ("Add type hints to", "Rename the local variables of"):
            rows.append({"question_id": f"same-code-{index}-{edit.split()[0].lower()}", "category": "same-code",
                         "turns": [f"{edit} this Python function ({name}) and return the whole function.\n\n{code}"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--functions", type=int, default=6)
    args = parser.parse_args()
    rows = questions(small_functions(args.functions))
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{len(rows)} questions -> {args.out}")


if __name__ == "__main__":
    main()
