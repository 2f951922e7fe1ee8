"""The fused w4a8 decoder layer (w4a8_layer.cpp): equal to the PyTorch layers within float32 rounding, and a
token's logits bitwise the same whether it is decoded alone, verified in a chain, placed in a tree or batched
next to a sequence of another length; for each kernel variant this CPU runs."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model
from layer_checks import assert_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch, forward, pytorch_forward, tokens_of
from test_w4a8_linear import each_variant

from specdecode.models.kernels import w4a8_linear
from specdecode.models.kernels.w4a8_decoder import W4A8DecoderLayer
from specdecode.models.loader import load_model

# qwen3: q/k norms; mistral: window; qwen3_moe: q/k norms and a mixture of experts (w4a8_moe.cpp) in the layer
ARCHS = {"qwen2": {}, "llama": {}, "mistral": {}, "qwen3": {"head_dim": 32}, "qwen3_moe": {}}


@pytest.fixture(autouse=True, params=each_variant())
def variant(request, monkeypatch):
    """Every w4a8 model of a test runs on this kernel variant."""
    monkeypatch.setattr(w4a8_linear, "_kernel", w4a8_linear.load_variant(request.param))


def w4a8_model(tmp_path, arch: str, dtype: str, **overrides):
    folder = save_tiny_model(tmp_path / arch, arch, scale=0.15, **{**ARCHS[arch], **overrides})
    model = load_model(folder, dtype=dtype, quant="w4a8").model
    assert all(isinstance(layer, W4A8DecoderLayer) for layer in model.layers)
    return model


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


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_a_token_gets_the_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch(tmp_path, arch):
    assert_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch(w4a8_model(tmp_path, arch, "bfloat16"))
