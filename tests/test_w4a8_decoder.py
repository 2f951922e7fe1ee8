"""The fused w4a8 decoder layer (w4a8_layer.cpp): equal to the PyTorch layers within float32 rounding, and a
token's logits bitwise the same whether it is decoded alone, verified in a chain, placed in a tree or batched
next to a sequence of another length; for each kernel variant this CPU runs."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model
from test_w4a8_linear import each_variant
from torch import nn

from specdecode.models.loader import load_model
from specdecode.models.quant import w4a8_linear
from specdecode.models.quant.w4a8_decoder import W4A8DecoderLayer
from specdecode.models.rope import RopeTable, inverse_frequencies

ARCHS = {"qwen2": {}, "llama": {}, "mistral": {}, "qwen3": {"head_dim": 32}}  # qwen3: q/k norms; mistral: window


@pytest.fixture(autouse=True, params=each_variant())
def variant(request, monkeypatch):
    """Every w4a8 model of a test runs on this kernel variant."""
    monkeypatch.setattr(w4a8_linear, "_kernel", w4a8_linear.load_variant(request.param))


def w4a8_model(tmp_path, arch: str, dtype: str, **overrides):
    folder = save_tiny_model(tmp_path / arch, arch, scale=0.15, **{**ARCHS[arch], **overrides})
    model = load_model(folder, dtype=dtype, quant="w4a8").model
    assert all(isinstance(layer, W4A8DecoderLayer) for layer in model.layers)
    return model


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


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_layers_compute_what_the_pytorch_layers_compute(tmp_path, arch):
    model = w4a8_model(tmp_path, arch, "float32")
    tokens = tokens_of(40, seed=1)  # past mistral's window of 24, so the window's mask is used
    fused = forward(model, tokens, model.new_cache(40), 0, hidden_layers=(1, 2))
    reference = pytorch_forward(model, tokens)
    # Both round activations to int8, and an input a float32 rounding away from a rounding step flips a code
    # (about 1% of the output scale, here and there); a wrong mask, rope or norm would move every row by far more.
    for ours, theirs in [(fused.logits, reference.logits)] + [(fused.hidden[i], reference.hidden[i]) for i in (1, 2)]:
        assert ours.dtype == theirs.dtype
        scale = theirs.abs().max()
        by_row = (ours - theirs).abs().amax(-1)  # [1, T]
        assert by_row.max() < 0.05 * scale and by_row.median() < 1e-4 * scale

def test_bfloat16_cache_holds_what_the_pytorch_layers_write(tmp_path):
    model = w4a8_model(tmp_path, "qwen2", "bfloat16")
    tokens = tokens_of(20, seed=8)
    fused, reference = model.new_cache(20), model.new_cache(20)
    forward(model, tokens, fused, 0)
    pytorch_forward(model, tokens, reference)
    # The PyTorch layers round to bfloat16 after every op, the fused ones once at the cache write.
    for ours, theirs in ((fused.keys, reference.keys), (fused.values, reference.values)):
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0.05, atol=0.05 * theirs.abs().max().item())


def test_a_token_gets_the_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch(tmp_path):
    model = w4a8_model(tmp_path, "qwen2", "bfloat16")
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
