"""The chat prompts a target wrote itself for training (training/self_prompts.py): how diverse they are and
whether any overlaps the benchmark sets we measure on.

Run from the repository root, after `specdecode train ...` wrote them:
    python docs/benchmarks/self_prompt_check.py [--prompts CACHE/features/TARGET/self_prompts.jsonl]

Diversity: distinct prompts, distinct first words, and the share of distinct word 4-grams among all of them.
Overlap: every word 8-gram of every prompt looked up among the 8-grams of the HumanEval and MT-bench prompts in
../shared/data (a shared 8-gram is a copied phrase, not a coincidence); the prompts that share one are listed.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from specdecode.models.formats.drafter_folder import trained_folder

BENCHMARKS = (Path("../shared/data/humaneval/humaneval_specbench_format.jsonl"),
              Path("../shared/data/mt_bench/question.jsonl"))


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def grams(text: str, n: int) -> set[tuple[str, ...]]:
    tokens = words(text)
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", default=str(trained_folder("features", None) / "self_prompts.jsonl"))
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    benchmark = set()
    for path in BENCHMARKS:
        for line in path.read_text().splitlines():
            for turn in json.loads(line)["turns"]:
                benchmark |= grams(turn, 8)
    four = Counter(gram for prompt in prompts for gram in grams(prompt, 4))
    overlapping = [prompt for prompt in prompts if grams(prompt, 8) & benchmark]
    first_words = Counter(" ".join(words(prompt)[:3]) for prompt in prompts)
    median = sorted(len(words(prompt)) for prompt in prompts)[len(prompts) // 2]
    print(f"{len(prompts)} prompts, {len(set(prompts))} distinct, {len(first_words)} distinct first three words "
          f"(most common: {first_words.most_common(3)}), median {median} words; distinct word 4-grams "
          f"{len(four) / max(1, sum(four.values())):.1%} of all")
    print(f"{len(overlapping)} share a word 8-gram with the HumanEval or MT-bench prompts")
    for prompt in overlapping:
        print("  ", prompt[:200].replace("\n", " "))


if __name__ == "__main__":
    main()
