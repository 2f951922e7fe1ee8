"""Prompt lookup: if the last n tokens occurred before, propose what followed them then. No model.

With `ngram_branches` above 1, the continuations of several earlier matches are proposed together as a tree
(common prefixes merged, the most recent match first), so one verify forward checks them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdecode.acceptance.tree import tree_from_paths
from specdecode.drafters.base import Drafter, DrafterCaps, option
from specdecode.drafters.capabilities import MemorySizing
from specdecode.drafters.registry import register
from specdecode.errors import SpecDecodeError
from specdecode.spec_types import DraftProposal, Sequence


@dataclass(frozen=True)
class NgramOptions:
    ngram_min: int = option(1, "shortest suffix n-gram to look up", vllm="prompt_lookup_min", ge=1)
    ngram_max: int = option(4, "longest suffix n-gram to look up", vllm="prompt_lookup_max", ge=1)
    ngram_branches: int = option(1, "continuations of distinct earlier matches proposed as one tree (1 = a chain)",
                                 ge=1, le=8)

    def check(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SpecDecodeError(
                f"need 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min} ngram_max={self.ngram_max}")


@register
class NgramDrafter(Drafter, MemorySizing):
    name = "ngram"
    Options = NgramOptions
    caps = DrafterCaps(emits_trees=True)
    aliases = ("ngram-simple", "ngram-map-k")  # llama.cpp's --spec-type names
    tree_options = {"ngram_branches": 3}

    def __init__(self, options: NgramOptions):
        self.options = options

    @classmethod
    def create(cls, resources, options: NgramOptions) -> NgramDrafter:
        return cls(options)

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        o = self.options
        paths = find_continuations(seq.tokens, budget, o.ngram_min, o.ngram_max, o.ngram_branches)
        if len(paths) <= 1:
            return DraftProposal.chain(paths[0] if paths else [], source=self.name)
        tokens, parents = tree_from_paths(paths)
        return DraftProposal(torch.tensor(tokens), torch.tensor(parents), None, self.name)

    def max_nodes(self, budget: int) -> int:
        return budget * self.options.ngram_branches


def find_continuations(tokens: list[int], k: int, min_n: int, max_n: int, branches: int = 1) -> list[list[int]]:
    """Up to `branches` continuations of k tokens, from the most recent earlier occurrences of the longest
    matching suffix whose continuations differ (most recent first); [] if no suffix of min_n tokens recurs."""
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    history = np.asarray(tokens, dtype=np.int64)  # [L]
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = history[-n:]  # [n]
        # Windows that start early enough to be followed by at least one token (excludes the suffix itself).
        windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)  # [L-n, n]
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        paths: list[list[int]] = []
        for match in matches[::-1]:  # most recent first: its context is likeliest to repeat
            start = int(match) + n
            path = _copy_forward(history[start:].tolist(), len(tokens) - start, k)
            if path not in paths:
                paths.append(path)
                if len(paths) == branches:
                    break
        if paths:
            return paths
    return []


def _copy_forward(available: list[int], period: int, k: int) -> list[int]:
    """k tokens of the continuation; where it runs into the present, keep repeating with the match's period.

    A recent match overlaps the suffix in periodic text ("a b a b a b"), leaving fewer than k tokens to copy;
    predicting that the pattern goes on (an LZ77-style overlapping copy) keeps the draft full length.
    """
    draft = available[:k]
    while len(draft) < k:
        draft.append(draft[len(draft) - period])  # available holds exactly `period` tokens
    return draft
