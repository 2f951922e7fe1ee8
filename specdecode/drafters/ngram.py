"""Prompt lookup: if the last n tokens occurred before, propose what followed them then. No model."""

from __future__ import annotations

import numpy as np

from specdecode.drafters.base import DraftProposal, Drafter, DrafterContext, SequenceState, register


@register
class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    @classmethod
    def create(cls, context: DrafterContext) -> NgramDrafter:
        return cls(context.spec.ngram_min, context.spec.ngram_max)

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        return DraftProposal(find_continuation(seq.tokens, k, self.min_n, self.max_n), None, self.name)


def find_continuation(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
    if k <= 0 or len(tokens) < min_n + 1:
        return []
    history = np.asarray(tokens, dtype=np.int64)  # [L]
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = history[-n:]  # [n]
        # Windows that start early enough to be followed by at least one token (excludes the suffix itself).
        windows = np.lib.stride_tricks.sliding_window_view(history[:-1], n)  # [L-n, n]
        matches = np.flatnonzero((windows == suffix).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n  # most recent occurrence: its context is likeliest to repeat
            return _copy_forward(history[start:].tolist(), len(tokens) - start, k)
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
