"""Weight-only int8/int4 layers against float references, and quantized drafts keeping the output exact."""

from __future__ import annotations

from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import save_tiny_model
from gguf_files import Q4_K, random_k_blocks
from torch import nn

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models.formats.gguf_int4 import q4_k_groups
from specdecode.models.kernels.quantized_linear import Int4Linear, Int8Linear
from specdecode.models.loader import load_model


def linear(out_features=48, in_features=128, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
    return layer


def test_int8_matches_its_own_dequantized_weight_and_stays_near_float():
    layer = linear()
    x = torch.randn(5, 128)  # [R, K]
    quantized = Int8Linear.from_linear(layer)
    dequantized = quantized.weight.float() * quantized.scales.float()[:, None]  # [N, K]
    out = quantized(x)
    # The kernel computes exactly x @ (q * s)^T + b up to fp32 summation order.
    assert torch.allclose(out, F.linear(x, dequantized, layer.bias), atol=1e-4)
    # Rounding moves each weight by at most half a step (scale / 2), which bounds the output error.
    bound = (x.abs() @ (quantized.scales.float()[:, None] / 2).expand(-1, 128).t())  # [R, N]
    assert ((out - layer(x)).abs() <= bound + 1e-5).all()


@pytest.mark.parametrize("in_features", [8, 72])
def test_int8_in_bfloat16_is_right_when_the_inputs_are_not_a_multiple_of_16(in_features):
    """torch's int8 kernel reads past such rows in bfloat16 (garbage, NaN, or a crash: found as a DSpark Markov
    head of rank 8 drafting NaN now and then); the layer pads them with zero columns."""
    generator = torch.Generator().manual_seed(0)
    layer = nn.Linear(in_features, 48).to(torch.bfloat16)
    quantized = Int8Linear.from_linear(layer)
    dequantized = quantized.weight.float() * quantized.scales.float()[:, None]  # [N, K]
    for rows in (1, 2, 5) * 10:
        x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)  # [R, K]
        expected = F.linear(x.float(), dequantized, layer.bias.float())
        assert torch.allclose(quantized(x).float(), expected, atol=0.05, rtol=0.02)
    assert set(quantized.state_dict()) == {"weight", "scales", "bias"}, "the padded copy is not saved"


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_groups_reproduce_their_dequantized_weight(group_size):
    layer = linear()
    x = torch.randn(3, 128)
    quantized = Int4Linear.from_linear(layer, group_size)
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
    for quantized in (Int8Linear.from_linear(layer), Int4Linear.from_linear(layer, 32)):
        assert quantized(x).shape == (2, 4, 48)


def test_int4_needs_divisible_inputs():
    with pytest.raises(SpecDecodeError, match="divisible by the group size 32"):
        Int4Linear.from_linear(linear(in_features=48), 32)


def test_quantized_load_replaces_every_linear_including_the_head(tmp_path):
    folder = save_tiny_model(tmp_path / "m", "qwen2", scale=0.15)
    model = load_model(folder, dtype="float32", quant="int8").model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    with pytest.raises(SpecDecodeError, match="unknown quantization 'int3'"):
        load_model(folder, dtype="float32", quant="int3")


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


def q4_k_tensor(rows: int, columns: int) -> SimpleNamespace:
    """Random valid Q4_K blocks shaped like a GGUF reader's tensor (gguf-py has no Q4_K quantizer)."""
    return SimpleNamespace(data=random_k_blocks(Q4_K, rows, columns), shape=np.array([columns, rows]),
                           tensor_type=Q4_K)


def test_q4_k_blocks_become_int4_groups_with_the_same_weights():
    tensor = q4_k_tensor(rows=16, columns=512)
    reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))  # [N, K]
    codes, scales, zeros = q4_k_groups(tensor)
    rebuilt = ((codes.float() - 8).reshape(16, 16, 32) * scales[..., None] + zeros[..., None]).reshape(16, 512)
    assert torch.allclose(rebuilt, reference, atol=1e-6)
    layer = Int4Linear.from_groups([(codes, scales, zeros)], None, 32, torch.float32)
    x = torch.randn(3, 512)
    assert torch.allclose(layer(x), x @ reference.t(), atol=1e-4)


@pytest.mark.real_model
def test_default_draft_int4_layers_carry_the_gguf_weights_exactly():
    from specdecode.models.formats.default_models import DEFAULT_DRAFT
    from specdecode.models.loader import resolve_source

    model = load_model(DEFAULT_DRAFT, dtype="float32", quiet=True, quant="int4").model
    gguf_path = resolve_source(DEFAULT_DRAFT, quiet=True)
    reader = gguf.GGUFReader(gguf_path)
    q4_k = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_K]
    assert q4_k, "the default draft has Q4_K tensors"
    down = {t.name: t for t in q4_k}
    name = next(n for n in down if n.endswith("ffn_down.weight"))
    layer = model.layers[int(name.split(".")[1])].mlp.down
    reference = torch.from_numpy(gguf.quants.dequantize(down[name].data, down[name].tensor_type))  # [N, K]
    identity = torch.eye(reference.shape[1])  # [K, K]: the layer applied to it is its weight, transposed
    with torch.inference_mode():
        assert torch.allclose(layer(identity).t(), reference, atol=1e-6)
