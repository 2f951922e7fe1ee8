"""Checks shared by the tests of our fixed-order decoder layers (w4a8 and float): a forward with positions
from a start, the same model run by the PyTorch layers, and bitwise batch invariance."""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.rope import RopeTable, inverse_frequencies


def forward(model, tokens: torch.Tensor, cache, start: int, **kwargs):
    positions = torch.arange(start, start + tokens.shape[1]).expand(tokens.shape[0], -1)  # [B, T]
    with torch.inference_mode():
        return model(tokens, positions, cache, **kwargs)


def pytorch_forward(model, tokens: torch.Tensor, cache=None):
    """The same model run by the PyTorch layers (its own cos/sin table in the model's dtype)."""
    fused, rope = model.layers, model.rope
    model.layers = nn.ModuleList(layer.unfused() for layer in fused)
    model.rope = RopeTable(inverse_frequencies(model.config, model.rope_factors),
                           model.config.max_position_embeddings, model.dtype, model.device)
    try:
        return forward(model, tokens, cache or model.new_cache(tokens.shape[1]), 0, hidden_layers=(1, 2))
    finally:
        model.layers, model.rope = fused, rope


def tokens_of(count: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, count), generator=torch.Generator().manual_seed(seed))  # [B, T]


def assert_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch(model) -> None:
    """A token's logits are bitwise the same decoded alone, verified in a chain, placed in a tree (at other slot
    positions) and batched next to a sequence of another length."""
    prompt, chain = tokens_of(12, seed=2), tokens_of(4, seed=3)  # [1, 12], [1, 4]

    cache = model.new_cache(32)
    forward(model, prompt, cache, 0)
    alone = torch.cat([forward(model, chain[:, i : i + 1], cache, 12 + i).logits for i in range(4)], dim=1)

    cache = model.new_cache(32)
    forward(model, prompt, cache, 0)
    assert torch.equal(forward(model, chain, cache, 12).logits, alone)

    # A tree: the chain's first two tokens with a wrong sibling branch between them, slots in an order that
    # differs from the chain's.
    nodes = torch.cat([chain[:, :1], tokens_of(2, seed=4), chain[:, 1:2]], dim=1)  # [1, 4]
    parents = [-1, 0, 1, 0]  # node 1 (a wrong guess) under node 0, node 2 under node 1, node 3 (chain) under 0
    tree = torch.zeros(1, 4, 4, dtype=torch.bool)  # [1, T, T]
    depth = []
    for node, parent in enumerate(parents):
        tree[0, node, node] = True
        if parent >= 0:
            tree[0, node] |= tree[0, parent]
        depth.append(0 if parent < 0 else depth[parent] + 1)
    cache = model.new_cache(32)
    forward(model, prompt, cache, 0)
    with torch.inference_mode():
        logits = model(nodes, torch.tensor([depth]) + 12, cache, attn_mask=tree).logits  # [1, 4, V]
    assert torch.equal(logits[:, [0, 3]], alone[:, :2])

    # Two sequences of different lengths in one batch: the shorter one's logits are its own alone.
    pair = torch.cat([torch.cat([prompt, chain], dim=1), tokens_of(16, seed=5)])  # [2, 16]
    cache = model.new_cache(32, batch_size=2)
    forward(model, pair, cache, 0)
    cache.truncate(12, batch_index=0)
    with torch.inference_mode():
        batched = model(pair[:, 12:13], torch.tensor([[12], [16]]), cache).logits  # [2, 1, V]
    assert torch.equal(batched[:1], alone[:, :1])
    single = model.new_cache(32)
    forward(model, pair[1:], single, 0)
    assert torch.equal(batched[1:], forward(model, pair[1:, 12:13], single, 16).logits)
