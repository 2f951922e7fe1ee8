"""The chat-like training prompts (training/chat_tasks.py): how diverse they are and whether any overlaps the
benchmark sets we measure on.

Run from the repository root, after `specdecode train ... --chat-share F` listed the target's topics:
    python docs/benchmarks/chat_prompt_check.py [--topics CACHE/features/TARGET/chat_topics.json] [--count 2000]

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
from specdecode.training.chat_tasks import TOPICS_FILE, chat_prompts

BENCHMARKS = (Path("../shared/data/humaneval/humaneval_specbench_format.jsonl"),
              Path("../shared/data/mt_bench/question.jsonl"))


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def grams(text: str, n: int) -> set[tuple[str, ...]]:
    tokens = words(text)
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--topics", default=str(trained_folder("features", None) / TOPICS_FILE))
    parser.add_argument("--count", type=int, default=2000, help="prompts to build (the first COUNT training uses)")
    args = parser.parse_args()
    topics = json.loads(Path(args.topics).read_text())
    print("topics listed:", ", ".join(f"{name} {len(listed)}" for name, listed in topics.items()))
    prompts = [text.text for text, _ in zip(chat_prompts(topics), range(args.count))]
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
