"""How much of the target's own output a reduced draft head can draft at all (issue #45): the share of the tokens
of the bench runs' plain outputs that fall inside a draft vocabulary of N ids, for N ids chosen three ways: the
lowest ids (`draft_vocab` without counts), the ids most frequent in this Python's standard library source (about
2.8M tokens, counted here), and, where `specdecode train vocab` wrote them, the ids the target emitted most in its
own answers (CACHE/vocab/TARGET). A token outside the set is one the draft cannot propose, so the step's chain
ends there: the share outside is a floor on the acceptance a reduced head loses.

Run from the repository root (reads every docs/benchmarks/*/results.json of the default target with `none`):
    python docs/benchmarks/draft_vocab_coverage.py [--sizes 8000,16000,32000,48000]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specdecode.models.formats.default_models import DEFAULT_MODELS, DEFAULT_TARGET, cache_dir
from specdecode.models.formats.drafter_folder import trained_folder
from specdecode.models.heads.draft_vocab import counted_ids, frequent_ids, read_counts
from specdecode.models.tokenizer import END_OF_TURN_TOKENS
from specdecode.training.data import code_texts


def plain_outputs(target: str) -> dict[str, collections.Counter]:
    """Token counts of the plain outputs of every bench run of `target` in docs/benchmarks, HumanEval apart from
    the rest (MT-bench and repeated workloads)."""
    outputs = {"HumanEval": collections.Counter(), "MT-bench": collections.Counter()}
    for path in sorted(Path("docs/benchmarks").glob("*/results.json")):
        results = json.loads(path.read_text())
        if results.get("setup", {}).get("target") != target or "none" not in results.get("questions", {}):
            continue
        for question in results["questions"]["none"][0]:
            counter = outputs["HumanEval" if question["category"] == "humaneval" else "MT-bench"]
            for turn in question["token_ids"]:
                counter.update(turn)
    return outputs


def coverage(ids: set[int], counts: collections.Counter) -> float:
    return sum(n for token, n in counts.items() if token in ids) / max(1, sum(counts.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="8000,16000,32000,48000")
    args = parser.parse_args()
    gguf = cache_dir() / "models" / DEFAULT_MODELS[DEFAULT_TARGET].filename
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    vocab = len(tokenizer)
    outputs = plain_outputs(DEFAULT_TARGET)
    print("plain output tokens:", {name: sum(c.values()) for name, c in outputs.items()})
    stdlib = torch.zeros(vocab, dtype=torch.long)  # [V]
    for text in code_texts():
        ids = tokenizer(text.text, add_special_tokens=False)["input_ids"]
        stdlib += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab)[:vocab]
    ends = frozenset(tokenizer.convert_tokens_to_ids(token) for token in END_OF_TURN_TOKENS
                     if token in tokenizer.get_vocab())
    # The sets draft_vocab drafts over (models/heads/draft_vocab.py): N ids filled to whole tiles, ends included.
    choices = {"lowest ids": lambda size: frequent_ids(size, vocab, ends),
               "standard library counts": lambda size: counted_ids(stdlib, size, ends)}
    answered = read_counts(trained_folder("vocab", DEFAULT_TARGET), vocab)
    if answered is not None:
        choices["the target's answers (train vocab)"] = lambda size: counted_ids(answered, size, ends)
    print("| ids | " + " | ".join(f"{choice}: {name}" for choice in choices for name in outputs) + " |")
    print("|---:|" + "---:|" * (len(choices) * len(outputs)))
    for size in (int(s) for s in args.sizes.split(",")):
        shares = [coverage(set(choose(size).tolist()), counts) for choose in choices.values()
                  for counts in outputs.values()]
        print(f"| {size} | " + " | ".join(f"{share:.1%}" for share in shares) + " |")
    for name, counts in outputs.items():
        outside = collections.Counter({t: n for t, n in counts.items() if t >= 32000})
        print(f"{name}, most frequent ids past the lowest 32000:",
              ", ".join(f"{tokenizer.convert_ids_to_tokens(t)!r} ({t}) {n / sum(counts.values()):.2%}"
                        for t, n in outside.most_common(8)))


if __name__ == "__main__":
    main()
