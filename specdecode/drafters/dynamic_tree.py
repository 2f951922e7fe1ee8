"""EAGLE-2's dynamic draft tree (Li et al. 2024), for any drafter that scores next tokens: candidates carry
their cumulative draft log-probability; each depth expands the best few, and the best of all are verified.

A child's score is its parent's plus a log-probability (<= 0), so sorting by (score descending, creation
order) always puts a node after its ancestors: any top-n selection is a tree, in topological order.
"""

from __future__ import annotations

import torch

from specdecode.acceptance.sampling import logits_to_probs
from specdecode.config import SamplingParams


class DynamicTree:
    def __init__(self, width: int):
        self.width = width  # children per expanded node, and nodes expanded per depth
        self.tokens: list[int] = []
        self.parents: list[int] = []  # -1 = the root (the last committed token)
        self.scores: list[float] = []  # cumulative log-probability from the root
        self.depths: list[int] = []
        self.fed: list[int] = []  # nodes fed to the drafter's model so far, in its cache-slot order

    def add_children(self, parent: int, log_probs: torch.Tensor, base_score: float) -> None:
        """The `width` most likely next tokens under log_probs [1, V] become children of `parent`."""
        values, ids = log_probs[0].topk(min(self.width, log_probs.shape[-1]))  # [W] each
        depth = 1 if parent < 0 else self.depths[parent] + 1
        for value, token in zip(values.tolist(), ids.tolist()):
            if value == float("-inf"):  # the sampling transform removed it: it can never be accepted
                continue
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(base_score + value)
            self.depths.append(depth)

    def _ranked(self, nodes) -> list[int]:
        return sorted(nodes, key=lambda n: (-self.scores[n], n))

    def best_of_depth(self, depth: int) -> list[int]:
        """The nodes of `depth` to expand next."""
        return self._ranked(n for n, d in enumerate(self.depths) if d == depth)[: self.width]

    def feed(self, nodes: list[int]) -> torch.Tensor:
        """Record that `nodes` go to the model next -> their attention mask [len(nodes), fed + len(nodes)] over
        the tree nodes already in its cache and themselves: each sees its own ancestors and itself."""
        columns = self.fed + nodes
        slot = {node: i for i, node in enumerate(columns)}
        mask = torch.zeros(len(nodes), len(columns), dtype=torch.bool)  # [W, fed + W]
        for row, node in enumerate(nodes):
            mask[row, len(self.fed) + row] = True
            ancestor = self.parents[node]
            while ancestor >= 0:
                mask[row, slot[ancestor]] = True
                ancestor = self.parents[ancestor]
        self.fed = columns
        return mask

    def select(self, budget: int) -> tuple[list[int], list[int]]:
        """The best `budget` nodes -> (tokens [N], parents [N]) in topological order."""
        chosen = sorted(self._ranked(range(len(self.tokens)))[:budget])  # creation order is topological
        index = {node: i for i, node in enumerate(chosen)}
        return [self.tokens[n] for n in chosen], [index.get(self.parents[n], -1) for n in chosen]


def tree_log_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """logits [R, V] -> log q [R, V], the scores tree children are ranked by: under the request's sampling
    transform (greedy: the plain softmax), so a token the transform removes is never a child."""
    if sampling.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return logits_to_probs(logits, sampling).log()
