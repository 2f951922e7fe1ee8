"""w3a8: the w4a8 kernel over 3-bit codes (a draft model's cheaper form). The packing against its own inverse, the
range search against min-max, each variant against float64 and bitwise against the others, batch invariance, and
greedy identity with a w3a8 draft. The driver runs 3-bit codes on every instruction set (test_kernel_driver.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model
from test_w4a8_linear import assert_reloads_from_the_cache, each_variant, kernel_inputs, unpacked_codes, unpacked_weight

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models.batch_invariance import batch_invariant
from specdecode.models.kernels import w4a8_linear
from specdecode.models.kernels.quantized_linear import searched_groups
from specdecode.models.kernels.w4a8_linear import W4A8Linear, pack_tiles
from specdecode.models.loader import load_model


def three_bit_layer(out_features: int, in_features: int, seed: int = 0) -> tuple[W4A8Linear, torch.Tensor]:
    """A w3a8 layer of a random weight, and the weight [N, K] it computes with."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    layer = W4A8Linear.from_rows([weight], None, bits=3)
    return layer, unpacked_weight(layer)


def test_codes_pack_into_three_bits_and_unpack_to_themselves():
    codes = torch.randint(0, 8, (32, 64), generator=torch.Generator().manual_seed(1))  # [N, K]
    scales, offsets = torch.ones(32, 2), torch.zeros(32, 2)  # [N, G]
    packed, _, _ = pack_tiles(codes, scales, offsets, bits=3)
    assert packed.shape == (2, 2, 192)  # 3 bits x 16 rows x 32 inputs per tile and group
    quads = unpacked_codes(packed)  # [T, G, 8, 16, 4]
    assert torch.equal(quads.permute(0, 3, 1, 2, 4).reshape(32, 64), codes.to(torch.uint8))


def test_the_searched_range_is_never_worse_than_min_max_and_negative_scales_flip():
    weight = torch.randn(32, 320, generator=torch.Generator().manual_seed(7)) * 0.05  # [N, K]: 10 groups, 2 blocks

    def error(groups: tuple[torch.Tensor, ...]) -> torch.Tensor:  # [N, G]
        codes, scales, offsets = groups
        values = codes.float().view(32, 10, 32) * scales[..., None] + offsets[..., None]
        return ((values - weight.view(32, 10, 32)) ** 2).sum(-1)

    searched, minmax = searched_groups(weight, 3), searched_groups(weight, 3, search=False)
    assert searched[0].min() >= 0 and searched[0].max() <= 7
    assert (error(searched) <= error(minmax)).all() and error(searched).sum() < 0.9 * error(minmax).sum()
    codes, scales, offsets = searched
    negative = torch.zeros_like(scales, dtype=torch.bool)  # [N, G]
    negative[::3] = True
    # q s + o = (7 - q)(-s) + (o + 7 s): the packing flips such groups back to an unsigned scale.
    flipped = (torch.where(negative.repeat_interleave(32, dim=1), 7 - codes, codes),
               torch.where(negative, -scales, scales), torch.where(negative, offsets + 7 * scales, offsets))
    step = scales.repeat_interleave(32, dim=1)  # [N, K]
    values = codes * step + offsets.repeat_interleave(32, dim=1)  # [N, K]: the searched weights in float
    for groups in (searched, flipped):
        layer = W4A8Linear(*pack_tiles(*groups, bits=3), None)
        # 8-bit scale and offset codes move a weight by a few percent of a step at most.
        assert ((unpacked_weight(layer) - values).abs() <= 0.05 * step + 1e-6).all()


@pytest.mark.parametrize("isa", each_variant())
def test_each_variant_equals_a_float64_reference_at_three_bits(isa):
    kernel = w4a8_linear.load_variant(isa)
    layer, weight = three_bit_layer(96, 768, seed=4)  # 24 groups, 3 blocks of scale units
    full = W4A8Linear(layer.codes.clone().fill_(0xFF), layer.group_scales, layer.block_scales, None)  # codes 7
    for tested in (layer, full):
        weight = unpacked_weight(tested).double()  # [N, K]
        for rows in (1, 2, 5, 8, 9):  # one row, AVX2's paired tile (2-4), passes of 8 and a remainder
            x, activations = kernel_inputs(rows, tested, seed=rows)
            expected = activations @ weight.t()  # [M, N]
            ours = kernel.w4a8_mm(x, tested.codes, tested.group_scales, tested.block_scales).double()
            bound = 2**-18 * (activations.abs() @ weight.abs().t())
            assert ((ours - expected).abs() <= bound).all(), (isa, rows)


@pytest.mark.parametrize("first, second", [("avx512", "avx2"), ("avx512", "avx_vnni"), ("avx_vnni", "avx2")])
def test_variants_give_the_same_bits_at_three_bits(first, second):
    flags = w4a8_linear.cpu_flags()
    for name in (first, second):
        missing = [flag for flag in w4a8_linear.VARIANTS[name][0] if flag not in flags]
        if missing:
            pytest.skip(f"this CPU lacks {', '.join(missing)}, which the {name} kernel needs")
    layer, _ = three_bit_layer(64, 512, seed=5)
    for rows in (1, 3, 8, 11):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))  # [M, K]
        outputs = [w4a8_linear.load_variant(name).w4a8_mm(x, layer.codes, layer.group_scales, layer.block_scales)
                   for name in (first, second)]
        assert torch.equal(*outputs), rows


def test_each_row_gets_the_same_bits_alone_or_in_any_batch_at_three_bits():
    layer, _ = three_bit_layer(64, 256, seed=1)
    x = torch.randn(19, 256, generator=torch.Generator().manual_seed(2))  # [M, K]
    together = layer(x)
    for start, stop in ((0, 1), (3, 11), (5, 19), (18, 19)):
        assert torch.equal(layer(x[start:stop]), together[start:stop])


def test_a_w3a8_draft_is_lossless_and_reloads_from_the_cache(tmp_path, cache, monkeypatch):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    draft_folder = save_tiny_model(tmp_path / "d", "qwen2", scale=0.15, noise=0.02)
    draft = load_model(draft_folder, dtype="float32", quant="w3a8")
    layers = [m for m in draft.model.layers.modules() if isinstance(m, W4A8Linear)]
    assert layers and all(layer.bits == 3 for layer in layers)
    assert draft.model.lm_head.bits == 4  # the output head as in w4a8 (TINY_VOCAB rows fill whole tiles)
    assert batch_invariant(draft.model)  # fused layers on the kernel: it may draft in a batch's shared forwards
    engine = Engine(load_model(folder, dtype="float32", quant="w4a8"), draft)
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    accepted = 0
    for prompt in ("hello hello hello", "The quick brown fox"):
        plain = engine.complete(prompt, sampling, SpecConfig("none"))
        result = engine.complete(prompt, sampling, SpecConfig("draft"))
        assert result.token_ids == plain.token_ids, prompt
        accepted += result.stats.accepted_tokens
    assert accepted > 0
    assert_reloads_from_the_cache(monkeypatch, draft_folder, "w3a8", draft.model)


def test_w3a8_takes_groups_of_32_only(tmp_path):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    with pytest.raises(SpecDecodeError, match="w3a8 uses groups of 32"):
        load_model(folder, dtype="float32", quant="w3a8", group_size=64)
