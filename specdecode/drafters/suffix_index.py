"""Where the context's recent tokens occurred before, and which continuations followed how often.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) answers this with suffix trees over the request and over
earlier responses. We answer it from the token arrays themselves: the positions holding the context's last
token, narrowed to those preceded by the token before it, and so on, one match length at a time. That gives the
exact count of every continuation at every match length, costs 8 bytes a cached token instead of a tree node
per token and depth, and evicting a response is dropping its tokens. Earlier responses are searched through a
sorted order built once per change, so finding a token's positions is a binary search.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

SEPARATOR = -1  # between concatenated sequences: no match or continuation crosses it
MAX_OCCURRENCES = 64  # continuations counted per match length (the most recent ones): bounds a step's work


@dataclass
class Candidate:
    """A proposal tree in topological order, with each node's estimated probability of being accepted."""

    tokens: list[int]
    parents: list[int]  # -1 = hangs off the last context token
    probs: list[float]  # the share of earlier occurrences whose continuation starts with the node's path
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected accepted tokens if the earlier occurrences' frequencies hold (SuffixDecoding's score)."""
        return sum(self.probs)


class TokenIndex:
    """Token sequences concatenated with separators, and their positions sorted by token."""

    def __init__(self, sequences: list[np.ndarray]):
        parts = [np.append(np.asarray(seq, dtype=np.int64), SEPARATOR) for seq in sequences]
        self.tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)  # [N]
        self.order = np.argsort(self.tokens, kind="stable")  # [N] positions by token, then position
        self.sorted_tokens = self.tokens[self.order]  # [N]

    def positions_of(self, token: int) -> np.ndarray:
        low, high = np.searchsorted(self.sorted_tokens, [token, token + 1])
        return self.order[low:high]  # [n] ascending (a stable sort keeps positions in order)


def matches(tokens: np.ndarray, ends: np.ndarray, pattern: list[int], max_len: int) -> Iterator[tuple[int, np.ndarray]]:
    """(m, positions) for m = 1, 2, ...: the positions p (from `ends`, which hold the pattern's last token) where
    tokens[p-m+1 : p+1] equals the pattern's last m tokens and a continuation follows. Stops at the first m that
    has none (a longer match cannot occur where a shorter one does not)."""
    positions = ends[ends + 1 < len(tokens)]  # [n]
    positions = positions[tokens[positions + 1] != SEPARATOR]
    for m in range(1, min(max_len, len(pattern)) + 1):
        if m > 1:
            back = positions - (m - 1)  # [n] where the match's first token must be
            inside = back >= 0
            positions = positions[inside][tokens[back[inside]] == pattern[-m]]
        if positions.size == 0:
            return
        yield m, positions


def continuation_tree(tokens: np.ndarray, positions: np.ndarray, depth: int, max_nodes: int,
                      min_prob: float, match_len: int) -> Candidate:
    """The most probable continuations of the occurrences ending at `positions`, `depth` tokens deep at most:
    with max_nodes 0, one chain following the most frequent next token; else a tree of the max_nodes most
    probable nodes. Nodes below min_prob are left out."""
    recent = positions[-MAX_OCCURRENCES:][::-1]  # [n] most recent first, so ties favour recent text
    index = recent[:, None] + 1 + np.arange(depth)  # [n, depth]
    inside = index < len(tokens)
    rows = np.where(inside, tokens[np.minimum(index, len(tokens) - 1)], SEPARATOR)  # [n, depth]
    total = len(rows)
    child_of: dict[tuple[int, int], int] = {}  # (node, token) -> node; node 0 is the context's last token
    counts, node_tokens, node_parents = [total], [SEPARATOR], [-1]
    for row in rows.tolist():
        node = 0
        for token in row:
            if token == SEPARATOR:
                break
            child = child_of.get((node, token))
            if child is None:
                child = child_of[(node, token)] = len(counts)
                counts.append(0)
                node_tokens.append(token)
                node_parents.append(node)
            counts[child] += 1
            node = child
    children: dict[int, list[int]] = {}
    for node in range(1, len(counts)):
        children.setdefault(node_parents[node], []).append(node)
    chosen = _best_first(counts, children, max_nodes) if max_nodes else _most_frequent_path(counts, children)
    chosen = [node for node in chosen if counts[node] / total >= min_prob]  # ancestors are at least as likely
    slot = {node: i for i, node in enumerate(chosen)}
    return Candidate([node_tokens[node] for node in chosen],
                     [slot.get(node_parents[node], -1) for node in chosen],
                     [counts[node] / total for node in chosen], match_len)


def _most_frequent_path(counts: list[int], children: dict[int, list[int]]) -> list[int]:
    path, node = [], 0
    while node in children:
        node = max(children[node], key=counts.__getitem__)  # first of equals: the most recent occurrence's
        path.append(node)
    return path


def _best_first(counts: list[int], children: dict[int, list[int]], max_nodes: int) -> list[int]:
    """The max_nodes most frequent nodes; a child is never more frequent than its parent, so they form a tree."""
    heap = [(-counts[node], node) for node in children.get(0, [])]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < max_nodes:
        _, node = heapq.heappop(heap)
        chosen.append(node)
        for child in children.get(node, []):
            heapq.heappush(heap, (-counts[child], child))
    return chosen


def best_candidate(tokens: np.ndarray, ends: np.ndarray, pattern: list[int], max_len: int, budget: int,
                   spec_factor: float, max_nodes: int, min_prob: float) -> Candidate:
    """The highest-scoring proposal over every match length; a match of m tokens may propose m * spec_factor
    tokens deep (longer matches are more trustworthy). A length whose occurrences are the same as the next
    longer one's is skipped: the longer match has the same continuations and may go deeper."""
    found = list(matches(tokens, ends, pattern, max_len))
    best = Candidate([], [], [])
    for i, (m, positions) in enumerate(found):
        if i + 1 < len(found) and len(found[i + 1][1]) == len(positions):
            continue
        depth = min(budget, int(m * spec_factor))
        if depth < 1:
            continue
        candidate = continuation_tree(tokens, positions, depth, max_nodes, min_prob, m)
        if candidate.score >= best.score:  # equal scores: the longer match
            best = candidate
    return best
