"""Write the first N questions of each category of a Spec-Bench JSONL file, in file order.

`specdecode bench --per-category` applies to every dataset it is given; this makes one dataset's subset apart,
for example two MT-bench questions of each of its 8 categories beside 10 HumanEval prompts:

    python docs/benchmarks/first_per_category.py ../shared/data/mt_bench/question.jsonl 2 > mt_bench_2_per_category.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import Counter


def main(path: str, per_category: int) -> None:
    seen: Counter[str] = Counter()
    with open(path, encoding="utf-8") as questions:
        for line in questions:
            category = json.loads(line)["category"]
            seen[category] += 1
            if seen[category] <= per_category:
                sys.stdout.write(line)


if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[2].isdigit():
        sys.exit("usage: first_per_category.py QUESTIONS.jsonl N")
    main(sys.argv[1], int(sys.argv[2]))
