"""The fixed-order float layers (float_decoder.py): installed for bf16 and fp32 CPU models, equal to the PyTorch
layers within rounding, and a token's logits bitwise the same decoded alone, in a chain, in a tree or in a batch
(the PyTorch layers are not: that is checked too, so the test would notice if it stopped testing anything)."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model
from layer_checks import assert_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch, forward, pytorch_forward, tokens_of
from torch import nn

from specdecode.models.batch_invariance import batch_invariant
from specdecode.models.decoder.packed_linear import FAST_BF16_ROWS, PackedLinear, can_pack, native_bf16, rows_invariant
from specdecode.models.kernels.float_decoder import FloatDecoderLayer, fix_float_layers
from specdecode.models.kernels.w4a8_linear import load_kernel
from specdecode.models.loader import load_model

ARCHS = {"qwen2": {}, "llama": {}, "mistral": {}, "qwen3": {"head_dim": 32}}  # qwen3: q/k norms; mistral: window
# Wide enough that oneDNN takes its blocked kernels, as it does for real models.
WIDE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}


def float_model(tmp_path, arch: str, dtype: str, **overrides):
    folder = save_tiny_model(tmp_path / arch, arch, scale=0.15, **{**ARCHS[arch], **overrides})
    return load_model(folder, dtype=dtype, quiet=True).model


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_float_models_load_with_fixed_order_layers_and_are_batch_invariant(tmp_path, dtype):
    model = float_model(tmp_path, "qwen2", dtype, **WIDE)
    assert all(isinstance(layer, FloatDecoderLayer) for layer in model.layers)
    assert batch_invariant(model)
    assert_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch(model)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_pytorch_layers_are_not_batch_invariant(tmp_path, dtype):
    """What the fixed-order layers fix: with the PyTorch layers (oneDNN's single-row kernel and SDPA), a chain's
    logits differ from one-at-a-time decoding in their last bits."""
    model = float_model(tmp_path, "qwen2", dtype, **WIDE)
    model.layers = nn.ModuleList(layer.unfused() for layer in model.layers)
    model.lm_head = nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False).to(model.dtype)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.embed.weight)
    assert not batch_invariant(model)
    prompt, chain = tokens_of(12, seed=2), tokens_of(4, seed=3)
    cache = model.new_cache(32)
    forward(model, prompt, cache, 0)
    alone = torch.cat([forward(model, chain[:, i : i + 1], cache, 12 + i).logits for i in range(4)], dim=1)
    cache = model.new_cache(32)
    forward(model, prompt, cache, 0)
    assert not torch.equal(forward(model, chain, cache, 12).logits, alone)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fixed_order_layers_compute_what_the_pytorch_layers_compute(tmp_path, arch, dtype):
    model = float_model(tmp_path, arch, dtype)
    assert all(isinstance(layer, FloatDecoderLayer) for layer in model.layers)
    tokens = tokens_of(40, seed=1)  # past mistral's window of 24, so the window's mask is used
    ours = forward(model, tokens, model.new_cache(40), 0, hidden_layers=(1, 2))
    reference = pytorch_forward(model, tokens)
    # Attention in float32 over the cache against SDPA in the model's dtype: equal within the dtype's rounding.
    tolerance = 1e-4 if dtype == "float32" else 3e-2
    for mine, theirs in [(ours.logits, reference.logits)] + [(ours.hidden[i], reference.hidden[i]) for i in (1, 2)]:
        assert mine.dtype == theirs.dtype
        scale = theirs.float().abs().max()
        assert (mine.float() - theirs.float()).abs().max() < tolerance * scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_single_row_is_computed_as_two_so_it_matches_any_number_of_rows(dtype):
    linear = nn.Linear(256, 512).to(dtype)
    if not can_pack(linear):
        pytest.skip("oneDNN has no bf16 kernel on this CPU (no AVX-512): bf16 weights stay unpacked here")
    packed = PackedLinear(linear)
    assert rows_invariant(packed, torch.Generator().manual_seed(0), dtype)
    x = torch.randn(5, 256).to(dtype)  # [5, in]
    with torch.inference_mode():
        assert torch.equal(packed(x[None, None, 2]), packed(x)[None, None, 2])  # [1, 1, out] from [1, 1, in]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fewer_rows_than_the_fastest_count_are_padded_and_keep_their_bits(dtype):
    """Padding 1-3 rows to FAST_BF16_ROWS (bf16 on a CPU with native bf16 dot products) gives each row the bits
    of two rows (the unpadded product) and of any other count: the order of sums does not depend on the rows."""
    linear = nn.Linear(256, 1024).to(dtype)
    if not can_pack(linear):
        pytest.skip("oneDNN has no bf16 kernel on this CPU (no AVX-512): bf16 weights stay unpacked here")
    packed = PackedLinear(linear)
    native = dtype == torch.bfloat16 and native_bf16()
    assert packed.fewest_rows == (FAST_BF16_ROWS if native else 2)  # float32, or bf16 emulated: as before
    x = torch.randn(9, 256).to(dtype)  # [9, in]
    with torch.inference_mode():
        all_rows = packed(x)  # [9, out]
        for fewest in (2, FAST_BF16_ROWS):
            packed.fewest_rows = fewest
            for count in (1, 2, 3):
                assert torch.equal(packed(x[None, :count]), all_rows[None, :count]), (fewest, count)  # [1, M, out]
            assert packed(x[None, :0]).shape == (1, 0, 1024)  # no rows (a drafter's empty batch): nothing padded


def test_models_that_cannot_be_fixed_keep_their_layers_and_say_why(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "odd", "qwen2", scale=0.15, head_dim=24)
    model = load_model(folder, dtype="float32").model
    assert "not batch-invariant (the fixed-order attention needs a head size" in capsys.readouterr().err
    assert not any(isinstance(layer, FloatDecoderLayer) for layer in model.layers)
    assert "multiple of 16" in fix_float_layers(model)
    assert not batch_invariant(model)


@pytest.mark.parametrize("heads", [4, 14])  # 14: a group of 7 heads, two passes on AVX2
def test_causal_rows_visiting_slots_tile_by_tile_attend_bitwise_as_each_row_alone(heads):
    """attention.cpp has a block of causal rows (32: 70 rows make three) visit the slots in tiles of 256 (250
    cached + 70 new slots cross one), every row taking each tile in turn; each row must still get the bits it
    gets alone, fed one at a time, and the same under an explicit causal mask."""
    kv_heads, dim, new, capacity, starts = 2, 32, 70, 330, [250, 0]
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, new, (heads + 2 * kv_heads) * dim, generator=generator)  # [B, T, width]
    cache = [torch.randn(kv_heads, capacity, dim, generator=generator).to(torch.bfloat16) for _ in range(4)]
    slot = torch.arange(capacity).view(1, 1, 1, capacity)  # [1, 1, 1, S]
    row = torch.arange(new).view(1, 1, new, 1)  # [1, 1, T, 1]
    causal = slot <= torch.tensor(starts).view(2, 1, 1, 1) + row  # [B, 1, T, S]
    attend = load_kernel().attend

    def fresh_cache():
        return [t.clone() for t in cache[:2]], [t.clone() for t in cache[2:]]

    together = [attend(qkv, *fresh_cache(), starts, visible, heads, kv_heads, dim) for visible in (None, causal)]
    keys, values = fresh_cache()
    alone = torch.cat([attend(qkv[:, t : t + 1].contiguous(), keys, values, [start + t for start in starts], None,
                              heads, kv_heads, dim) for t in range(new)], dim=1)  # [B, T, H*D]
    assert torch.equal(together[0], alone) and torch.equal(together[1], alone)


def test_unpacked_bf16_weights_get_the_fixed_order_layers_only_where_the_probe_finds_them_row_invariant(
        tmp_path, monkeypatch):
    """Where oneDNN has no bf16 kernel (x86 without AVX-512) bf16 weights stay nn.Linear; PyTorch's own bf16
    matmul then runs them. The probe decides: fixed layers and bitwise invariance, or the PyTorch layers and why."""
    monkeypatch.setattr("specdecode.models.loader.can_pack", lambda model: False)
    model = float_model(tmp_path, "qwen2", "bfloat16", **WIDE)
    assert isinstance(model.lm_head, nn.Linear)
    if all(isinstance(layer, FloatDecoderLayer) for layer in model.layers):
        assert batch_invariant(model)
        assert_same_bits_alone_in_a_chain_in_a_tree_and_in_a_batch(model)
    else:
        assert "sums in an order that depends on the number of rows" in fix_float_layers(model)
        assert not batch_invariant(model)
