"""Pure tree helpers: parents, children, depths, ancestor masks and tries of a proposal's nodes.

Rows of a verify forward: row 0 is the root (the last committed token, not yet in the KV cache), row i+1 is
proposed node i. A node's position is the root's plus its depth, so siblings share a position and attend to
their ancestors only. A chain is the tree whose node i hangs off node i-1; it needs no mask (causal order is
the ancestor order) and its rollback is a truncate.
"""

from __future__ import annotations

import torch

from specdecode.errors import SpecDecodeError
from specdecode.spec_types import DraftProposal


def children_of(parents: list[int]) -> list[list[int]]:
    """Row r -> its children's node indices, in index order (row 0 = the root, row i+1 = node i)."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    return children


def depths(parents: list[int]) -> list[int]:
    """Depth of each node: 1 for the root's children (their position is the root's + 1)."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


def check_parents(parents: list[int]) -> None:
    """Topological order, or one clear error naming the first bad node (a drafter bug, caught before the model)."""
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise SpecDecodeError(f"draft tree: node {node} has parent {parent}; parents must come first")


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[N+1, N+1] bool: row r may attend to row c when c is r itself or one of its ancestors (the root included)."""
    size = len(parents) + 1
    mask = torch.eye(size, dtype=torch.bool)  # [N+1, N+1]
    mask[:, 0] = True
    for node, parent in enumerate(parents):
        mask[node + 1] |= mask[parent + 1]  # topological order: the parent's row is already complete
    return mask


def proposal_depth(proposal: DraftProposal) -> int:
    """Tokens the longest root-to-leaf path can commit (excluding the target's own next token)."""
    if proposal.is_chain:
        return proposal.size
    return max(depths(proposal.parent_list()), default=0)


def tree_from_paths(paths: list[list[int]]) -> tuple[list[int], list[int]]:
    """Token paths from the root, in priority order -> (tokens [N], parents [N]) of their trie.

    Shared prefixes become one node; siblings keep the order their paths came in (verification tries them in
    that order), and nodes are in topological order.
    """
    tokens: list[int] = []
    parents: list[int] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for path in paths:
        parent = -1
        for token in path:
            node = index.get((parent, token))
            if node is None:
                node = index[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node
    return tokens, parents
