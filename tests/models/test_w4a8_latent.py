"""The fused w4a8 latent-attention layer (w4a8_latent.cpp), for each kernel variant this CPU runs: a w4a8
DeepSeek-V3 (low-rank query, YaRN, groups) or GLM-4.7-Flash (one query matmul) loads with its trunk fused, computes
what the PyTorch fixed-order layers compute within float32 rounding, and gives a token the same bits alone, in a
chain, in a tree and in a batch."""

from __future__ import annotations

import pytest
from conftest import save_tiny_model
from layer_checks import assert_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch, forward, pytorch_forward, tokens_of
from test_w4a8_linear import each_variant

from specdecode.models.families import family_of
from specdecode.models.kernels import w4a8_linear
from specdecode.models.kernels.w4a8_latent import W4A8LatentDecoderLayer
from specdecode.models.loader import load_model

# q_lora_rank 32: w4a8 tiles need the low rank a multiple of 32 (the tiny config's 24 keeps DeepSeek in PyTorch)
ARCHS = {"deepseek_v3": {"q_lora_rank": 32}, "glm4_moe_lite": {}}


@pytest.fixture(autouse=True, params=each_variant())
def variant(request, monkeypatch):
    """Every w4a8 model of a test runs on this kernel variant."""
    monkeypatch.setattr(w4a8_linear, "_kernel", w4a8_linear.load_variant(request.param))


def w4a8_model(tmp_path, arch: str, dtype: str):
    model = load_model(save_tiny_model(tmp_path / arch, arch, scale=0.15, **ARCHS[arch]), dtype=dtype,
                       quant="w4a8").model
    assert all(isinstance(layer, W4A8LatentDecoderLayer) for layer in model.layers)
    assert family_of(model.config).batch_invariant(model)
    return model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_fused_layers_compute_what_the_pytorch_layers_compute(tmp_path, arch):
    model = w4a8_model(tmp_path, arch, "float32")
    tokens = tokens_of(40, seed=1)
    fused = forward(model, tokens, model.new_cache(40), 0, hidden_layers=(1, 2))
    reference = pytorch_forward(model, tokens)
    # As the dense fused layers (test_w4a8_decoder.py): int8 activations may flip a code here and there; a wrong
    # norm, rope, scale or head product would move every row by far more.
    for ours, theirs in [(fused.logits, reference.logits)] + [(fused.hidden[i], reference.hidden[i]) for i in (1, 2)]:
        scale = theirs.abs().max()
        by_row = (ours - theirs).abs().amax(-1)  # [1, T]
        assert by_row.max() < 0.05 * scale and by_row.median() < 1e-4 * scale


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_token_gets_the_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch(tmp_path, arch):
    assert_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch(w4a8_model(tmp_path, arch, "bfloat16"))
