"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024): propose what followed the context's recent tokens,
in this request and in earlier responses, weighted by how often each continuation occurred. No model.

Per step, every match length of the context's suffix is looked up in the request's own tokens and in a cache
of earlier responses that lives as long as the Engine (a match and its continuation span `suffix_max_depth`
tokens at most, the reference's tree depth); each yields a proposal of up to `suffix_spec_factor` tokens per
matched token whose nodes are the continuations seen at least `suffix_min_prob` of the time; the proposal with
the most expected accepted tokens wins. With `suffix_tree_nodes`, the likeliest continuation nodes (that many
at most, and no more than the match length allows) are proposed as one tree.

The cache keeps the last `suffix_cache_requests` finished responses (first in, first out) and is shared by
every request of the Engine with the same options: a response can shape another user's drafts (never their
output, which verification fixes, but their speed). `serve` therefore turns it off unless asked; the Python
API and `generate` keep it on.

Drafts are those of the reference implementation (Arctic Inference's suffix trees, which vLLM's `suffix` runs):
the same counts, match lengths, scores and tie order, checked on 240 cases (tests/drafters/test_suffix_oracle.py). One
difference: a response enters our cache when its request finishes; the reference adds it token by token, so
a running request also drafts from its own and other running responses through the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources, NoOptions, option
from specdecode.drafters.capabilities import AutoMember, MemorySizing
from specdecode.drafters.registry import register
from specdecode.drafters.suffix_index import Candidate, TokenIndex, best_candidate
from specdecode.spec_types import DraftProposal, Sequence


@dataclass(frozen=True)
class SuffixOptions(NoOptions):
    suffix_max_depth: int = option(24, "tokens a match and its continuation span at most (the suffix trees' depth)",
                                   vllm="suffix_decoding_max_tree_depth", ge=1, le=256)
    suffix_spec_factor: float = option(1.0, "draft tokens per matched token (longer matches propose more)",
                                       vllm="suffix_decoding_max_spec_factor", gt=0, le=64)
    suffix_min_prob: float = option(0.1, "least share of earlier occurrences a proposed continuation needs",
                                    vllm="suffix_decoding_min_token_prob", ge=0, le=1)
    suffix_cache_requests: int = option(1000, "finished responses kept to draft later requests from "
                                              "(0 = none; serve's default)",
                                        vllm="suffix_decoding_max_cached_requests", serve_default=0, ge=0,
                                        le=1_000_000)
    suffix_tree_nodes: int = option(0, "nodes of a proposal tree over several continuations "
                                       "(0 = one chain, the most frequent)", ge=0, le=64)


class ResponseCache:
    """The last `limit` finished responses, searchable as one TokenIndex (rebuilt when a response enters)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.responses: deque[np.ndarray] = deque()  # each [n] int64, oldest first
        self.index = TokenIndex([])

    def add(self, response: list[int]) -> None:
        if not self.limit or not response:
            return
        self.responses.append(np.asarray(response, dtype=np.int64))
        while len(self.responses) > self.limit:
            self.responses.popleft()
        self.index = TokenIndex(list(self.responses))

    @property
    def tokens(self) -> int:
        return sum(len(response) for response in self.responses)

    @property
    def bytes(self) -> int:
        """Memory held: the concatenated tokens and their sorted order and values (8 bytes each)."""
        return self.index.tokens.nbytes + self.index.order.nbytes + self.index.sorted_tokens.nbytes


@register
class SuffixDrafter(Drafter, AutoMember, MemorySizing):
    name = "suffix"
    auto_rank = 0  # free to run, often right on code and edits: auto asks it first
    Options = SuffixOptions
    caps = DrafterCaps(emits_trees=True)
    vllm_method = "suffix"
    tree_options = {"suffix_tree_nodes": 12}

    @classmethod
    def found_for(cls, resources: DrafterResources) -> str:
        return "free, for text that repeats"

    def __init__(self, options: SuffixOptions):
        self.options = options
        self.cache = ResponseCache(options.suffix_cache_requests)

    @classmethod
    def create(cls, resources, options: SuffixOptions) -> SuffixDrafter:
        return cls(options)

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        best = self.candidate(seq.tokens, budget)
        if not best.tokens:
            return DraftProposal.empty(self.name)
        if self.options.suffix_tree_nodes == 0:
            return DraftProposal.chain(best.tokens, source=self.name)
        return DraftProposal(torch.tensor(best.tokens), torch.tensor(best.parents), None, self.name)

    def candidate(self, tokens: list[int], budget: int) -> Candidate:
        """The better of the request's own text and the response cache (the request's on equal scores)."""
        if budget <= 0 or not tokens:
            return Candidate([], [], [])
        context = np.asarray(tokens, dtype=np.int64)  # [L]
        best = self._search(context, np.flatnonzero(context == tokens[-1]), tokens, budget)
        if self.cache.responses:
            cached = self._search(self.cache.index.tokens, self.cache.index.positions_of(tokens[-1]), tokens, budget)
            if cached.score > best.score:
                best = cached
        return best

    def _search(self, tokens: np.ndarray, ends: np.ndarray, pattern: list[int], budget: int) -> Candidate:
        o = self.options
        return best_candidate(tokens, ends, pattern, o.suffix_max_depth, budget, o.suffix_spec_factor,
                              o.suffix_tree_nodes, o.suffix_min_prob)

    def start(self, seq: Sequence, prefill) -> None:
        seq.drafter_state[self.name] = "running"  # so a second finish() of one request caches nothing twice

    def finish(self, seq: Sequence) -> None:
        if seq.drafter_state.pop(self.name, None):
            self.cache.add(seq.tokens[seq.prompt_len:])

    def max_nodes(self, budget: int) -> int:
        return max(budget, self.options.suffix_tree_nodes)

    def cache_bytes(self) -> int:
        return self.cache.bytes
