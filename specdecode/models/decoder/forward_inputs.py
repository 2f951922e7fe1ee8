"""The inputs of a forward over new rows, and several sequences' rows in one forward: padding their inputs to
one length, and which of them can share a forward.

Sequence b's rows are its root and proposed nodes, T_b of them; the forward runs T = max T_b rows for each.
Padding rows repeat the root's position with token 0 and see what a causal row would: they come after every
real row, so no real row sees them, and the sequence's commit drops their cache slots with the rejected nodes.
Each sequence keeps its own cache (kv_cache.py's CacheBatch joins them for the forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardInputs:
    """The inputs of one forward over new rows (a prefill chunk, or a verify forward's root and proposed nodes)."""

    tokens: torch.Tensor  # [B, T] token ids
    positions: torch.Tensor  # [B, T] each row's position (tree nodes share their depth's)
    mask: torch.Tensor | None  # [B, T, T] which new rows each new row sees; None = causal


def padded_inputs(inputs: list[ForwardInputs]) -> ForwardInputs:
    """Each sequence's verify inputs ([1, T_b] tokens and positions, [1, T_b, T_b] mask or None) -> one batch
    [B, T] (mask [B, T, T], or None when every sequence's rows are a chain)."""
    rows = max(item.tokens.shape[1] for item in inputs)
    device = inputs[0].tokens.device
    tokens = torch.zeros(len(inputs), rows, dtype=torch.long, device=device)  # [B, T]
    positions = torch.empty(len(inputs), rows, dtype=torch.long, device=device)  # [B, T]
    for b, item in enumerate(inputs):
        own = item.tokens.shape[1]
        tokens[b, :own] = item.tokens[0]
        positions[b, :own] = item.positions[0]
        positions[b, own:] = item.positions[0, 0]
    if all(item.mask is None for item in inputs):
        return ForwardInputs(tokens, positions, None)
    mask = torch.ones(rows, rows, dtype=torch.bool, device=device).tril().repeat(len(inputs), 1, 1)  # [B, T, T]
    for b, item in enumerate(inputs):
        if item.mask is not None:
            own = item.tokens.shape[1]
            mask[b, :own, :own] = item.mask[0]
    return ForwardInputs(tokens, positions, mask)


def forward_groups(starts: list[int], rows: list[int], capacities: list[int]) -> list[list[int]]:
    """Which sequences share a forward: every one whose cache has room for the longest row count (from its
    start), and each of the rest alone. The longest always fits its own cache, so the first group holds it."""
    longest = max(rows)
    fits = [starts[b] + longest <= capacities[b] for b in range(len(rows))]
    return [[b for b in range(len(rows)) if fits[b]]] + [[b] for b in range(len(rows)) if not fits[b]]
