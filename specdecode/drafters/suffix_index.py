"""Where the context's recent tokens occurred before, and which continuations followed how often.

SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975) keeps suffix trees, bounded in depth, over the request and
over earlier responses; Arctic Inference's implementation is the reference (tests/fixtures/suffix_arctic holds
its answers). We compute the same counts from the token arrays themselves: the positions holding the context's
last token, narrowed to those preceded by the token before it, and so on, one match length at a time; a node's
children are the distinct tokens that follow its occurrences. The counts are those of the suffix tree (every
occurrence of a pattern counts, the context's own end and a response's last tokens included, as long as
pattern and continuation fit in `max_depth` tokens), each token costs 8 bytes instead of a tree node per token
and depth, and evicting a response is dropping its tokens. Earlier responses are searched through a sorted
order built once per change, so finding a token's positions is a binary search.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

SEPARATOR = -1  # between concatenated sequences: no match or continuation crosses it


@dataclass
class Candidate:
    """A proposal tree in topological order, with each node's estimated probability of being accepted."""

    tokens: list[int]
    parents: list[int]  # -1 = hangs off the last context token
    probs: list[float]  # the share of the pattern's occurrences whose continuation starts with the node's path
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected accepted tokens if the occurrences' frequencies hold (SuffixDecoding's score)."""
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
    """(m, positions) for m = 1 .. max_len: every position p (from `ends`, which hold the pattern's last token)
    where tokens[p-m+1 : p+1] equals the pattern's last m tokens. Stops at the first m without one (a longer
    match cannot occur where a shorter one does not)."""
    positions = ends  # [n]
    for m in range(1, min(max_len, len(pattern)) + 1):
        if m > 1:
            back = positions - (m - 1)  # [n] where the match's first token must be
            inside = back >= 0
            positions = positions[inside][tokens[back[inside]] == pattern[-m]]
        if positions.size == 0:
            return
        yield m, positions


class _Node:
    """A node below the matched pattern: `at` [n] holds, for each of its occurrences, the position of its last
    token; `room` is how many more tokens the depth bound lets it grow."""

    __slots__ = ("at", "room")

    def __init__(self, at: np.ndarray, room: int):
        self.at, self.room = at, room

    def children(self, tokens: np.ndarray) -> list[tuple[int, _Node]]:
        """(token, child) by count, most first. Equal counts in the reference suffix tree's sibling order: a child
        seen once by its first appearance; a child whose count grew, the latest to reach its count first (an
        incremented node moves to the head of its new count's group)."""
        if self.room <= 0:
            return []
        following = self.at + 1  # [n]
        following = following[following < len(tokens)]
        following = following[tokens[following] != SEPARATOR]
        if following.size == 0:
            return []
        values, inverse = np.unique(tokens[following], return_inverse=True)
        groups = [following[inverse == i] for i in range(len(values))]
        order = sorted(range(len(values)),
                       key=lambda i: (-len(groups[i]), groups[i][0] if len(groups[i]) == 1 else -groups[i][-1]))
        return [(int(values[i]), _Node(groups[i], self.room - 1)) for i in order]


def path_candidate(tokens: np.ndarray, positions: np.ndarray, match_len: int, max_tokens: int, room: int,
                   min_prob: float) -> Candidate:
    """Follow the most frequent child while the path's probability stays at min_prob or above."""
    node, prob = _Node(positions, room), 1.0
    chosen: list[int] = []
    probs: list[float] = []
    while len(chosen) < max_tokens:
        children = node.children(tokens)
        if not children:
            break
        token, child = children[0]
        prob *= len(child.at) / len(node.at)
        if prob < min_prob:
            break
        chosen.append(token)
        probs.append(prob)
        node = child
    return Candidate(chosen, list(range(-1, len(chosen) - 1)), probs, match_len)


def tree_candidate(tokens: np.ndarray, positions: np.ndarray, match_len: int, max_tokens: int, max_depth: int,
                   room: int, min_prob: float) -> Candidate:
    """The max_tokens most probable nodes at min_prob or above, at most max_depth deep (best first; a child is
    never more probable than its parent, so they form a tree)."""
    candidate = Candidate([], [], [], match_len)
    heap = []  # (-prob, push order, parent slot, depth, token, node)
    pushed = 0

    def push_children(node: _Node, prob: float, slot: int, depth: int) -> None:
        nonlocal pushed
        if depth >= max_depth:
            return
        for token, child in node.children(tokens):
            child_prob = prob * len(child.at) / len(node.at)
            if child_prob < min_prob:
                break  # children come most frequent first
            heapq.heappush(heap, (-child_prob, pushed, slot, depth + 1, token, child))
            pushed += 1

    push_children(_Node(positions, room), 1.0, -1, 0)
    while heap and len(candidate.tokens) < max_tokens:
        negative_prob, _, parent, depth, token, node = heapq.heappop(heap)
        candidate.tokens.append(token)
        candidate.parents.append(parent)
        candidate.probs.append(-negative_prob)
        push_children(node, -negative_prob, len(candidate.tokens) - 1, depth)
    return candidate


def best_candidate(tokens: np.ndarray, ends: np.ndarray, pattern: list[int], max_depth: int, budget: int,
                   spec_factor: float, tree_nodes: int, min_prob: float) -> Candidate:
    """The highest-scoring proposal over every match length m (1 up to one less than the pattern, at most
    max_depth - 1): m * spec_factor tokens at most (longer matches are more trustworthy), `budget` deep; with
    tree_nodes, a tree of at most that many nodes. Equal scores go to the longer match. A length whose
    occurrences are those of the next longer one is skipped where the depth bound does not bind: the longer
    match counts the same continuations and may propose more."""
    pattern = pattern[-max_depth:]
    found = list(matches(tokens, ends, pattern, len(pattern) - 1))
    best = Candidate([], [], [])
    for i, (m, positions) in enumerate(found):
        if i + 1 < len(found) and len(found[i + 1][1]) == len(positions) and max_depth - m - 1 >= budget:
            continue
        limit = int(m * spec_factor + 1e-6)  # as the reference rounds
        if tree_nodes:
            candidate = tree_candidate(tokens, positions, m, min(tree_nodes, limit), budget, max_depth - m, min_prob)
        else:
            candidate = path_candidate(tokens, positions, m, min(budget, limit), max_depth - m, min_prob)
        if candidate.score >= best.score:
            best = candidate
    return best
