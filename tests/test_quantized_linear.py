"""Weight-only int8/int4 layers against float references, and quantized drafts keeping the output exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_model
from torch import nn

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models.loader import load_model
from specdecode.models.quantized_linear import Int4Linear, Int8Linear, quantize_linears


def linear(out_features=48, in_features=128, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    return layer


def test_int8_matches_its_own_dequantized_weight_and_stays_near_float():
    layer = linear()
    x = torch.randn(5, 128)  # [R, K]
    quantized = Int8Linear(layer)
    dequantized = quantized.weight.float() * quantized.scales.float()[:, None]  # [N, K]
    out = quantized(x)
    # The kernel computes exactly x @ (q * s)^T + b up to fp32 summation order.
    assert torch.allclose(out, F.linear(x, dequantized, layer.bias), atol=1e-4)
    # Rounding moves each weight by at most half a step (scale / 2), which bounds the output error.
    bound = (x.abs() @ (quantized.scales.float()[:, None] / 2).expand(-1, 128).t())  # [R, N]
    assert ((out - layer(x)).abs() <= bound + 1e-5).all()


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_groups_reproduce_their_dequantized_weight(group_size):
    layer = linear()
    x = torch.randn(3, 128)
    quantized = Int4Linear(layer, group_size)
    # Rebuild w = low + q * scale group by group, as the layer defines it, straight from the float weight.
    groups = layer.weight.detach().reshape(48, 128 // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = (high - low) / 15
    expected = (low + torch.round((groups - low) / scale) * scale).reshape(48, 128)
    assert torch.allclose(quantized(x), F.linear(x, expected, layer.bias), atol=1e-3)
    # Each weight moves by at most half a step, so the error grows with the group's range.
    assert (expected - layer.weight).abs().max() <= scale.max() / 2 + 1e-6


def test_three_dimensional_activations_keep_their_shape():
    layer = linear(bias=False)
    x = torch.randn(2, 4, 128)  # [B, T, K]
    for quantized in (Int8Linear(layer), Int4Linear(layer, 32)):
        assert quantized(x).shape == (2, 4, 48)


def test_int4_needs_divisible_inputs():
    with pytest.raises(SpecDecodeError, match="divisible by the group size 32"):
        Int4Linear(linear(in_features=48), 32)


def test_quantize_linears_replaces_every_linear_including_the_head(tmp_path):
    model = load_model(save_tiny_model(tmp_path / "m", "qwen2", scale=0.15), dtype="float32").model
    quantize_linears(model, "int8")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    with pytest.raises(SpecDecodeError, match="unknown quantization 'int3'"):
        quantize_linears(model, "int3")


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_draft_keeps_greedy_output_of_the_float_target(tmp_path, quant):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    target = load_model(folder, dtype="float32")
    draft = load_model(folder, dtype="bfloat16", quant=quant)  # the target's own weights, squeezed
    engine = Engine(target, draft)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in ("hello hello hello", "The quick brown fox"):
        plain = engine.complete(prompt, sampling, SpecConfig("none"))
        result = engine.complete(prompt, sampling, SpecConfig("draft"))
        assert result.token_ids == plain.token_ids
        assert 0 < result.stats.accepted_tokens <= result.stats.drafted_tokens


def test_quantized_target_is_lossless_against_itself(tmp_path):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    target = load_model(folder, dtype="bfloat16", quant="int8")
    engine = Engine(target, load_model(folder, dtype="bfloat16", quant="int4"))
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = engine.complete("hello hello hello", sampling, SpecConfig("none"))
    for method in ("ngram", "draft", "ngram,draft"):
        assert engine.complete("hello hello hello", sampling, SpecConfig(method)).token_ids == plain.token_ids
