"""int4 x int8 (w4a8) layers: the kernel against a reference in PyTorch, each instruction-set variant against
float64 and bitwise against the others, the variant a CPU gets, bitwise batch invariance, and greedy identity of
every method on a w4a8 target."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model
from gguf_files import Q4_K, Q6_K, write_gguf

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models import cpu_features, quantized_model
from specdecode.models.kernels import w4a8_linear
from specdecode.models.kernels.quantized_linear import Int4Linear, Int8Linear, minmax_groups
from specdecode.models.kernels.w4a8_linear import ISA_SETTING, VARIANTS, W4A8Linear
from specdecode.models.loader import load_model


def each_variant() -> list:
    """One pytest param per kernel variant, skipped (with the flags it lacks) where this CPU cannot run it."""
    flags = w4a8_linear.cpu_flags()
    params = []
    for name, (needed, _) in VARIANTS.items():
        missing = [flag for flag in needed if flag not in flags]
        params.append(pytest.param(name, id=name, marks=pytest.mark.skipif(
            bool(missing), reason=f"this CPU lacks {', '.join(missing)}, which the {name} kernel needs")))
    return params


def layer_and_weight(out_features: int, in_features: int, seed: int = 0) -> tuple[W4A8Linear, torch.Tensor]:
    """A w4a8 layer of a random weight, and the weight [N, K] it computes with."""
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    layer = W4A8Linear.from_groups([minmax_groups(weight, 32)], None)
    return layer, unpacked_weight(layer)


def unpacked_codes(packed: torch.Tensor) -> torch.Tensor:
    """[T, G, 256] (4-bit) or [T, G, 192] (3-bit) uint8 in w4a8_core.cpp's layout -> [T, G, 8, 16, 4] codes: quad
    j (inputs 4j..4j+3), row, input in the quad."""
    tiles, groups, size = packed.shape
    if size == 256:
        nibbles = packed.view(tiles, groups, 4, 16, 4)  # [T, G, run, row, 4 inputs]
        return torch.cat([nibbles & 15, nibbles >> 4], dim=2)  # quads 0-3 low nibbles, 4-7 high ones
    first, second, third = packed.view(tiles, groups, 3, 16, 4).unbind(2)  # [T, G, row, 4 inputs] each
    quads = [first & 7, first >> 3 & 7, second & 7, second >> 3 & 7, third & 7, third >> 3 & 7,
             first >> 6 | (third >> 6 & 1) << 2, second >> 6 | (third >> 7) << 2]
    return torch.stack(quads, dim=2)


def unpacked_weight(layer: W4A8Linear) -> torch.Tensor:
    """[N, K] float32 from the kernel's layout (w4a8_core.cpp), undone step by step."""
    tiles, groups, _ = layer.codes.shape
    codes = unpacked_codes(layer.codes)  # [T, G, 8, 16, 4]
    codes = codes.permute(0, 3, 1, 2, 4).reshape(tiles * 16, groups, 32).float()  # [N, G, 32]

    def per_row(values: torch.Tensor) -> torch.Tensor:  # [T, X, 16] -> [N, X]
        return values.permute(0, 2, 1).reshape(tiles * 16, -1).float()

    units = per_row(layer.block_scales[..., :16]), per_row(layer.block_scales[..., 16:])  # [N, B] each
    scale_unit, offset_unit = (u.repeat_interleave(8, dim=1)[:, :groups] for u in units)  # [N, G] each
    scales = per_row(layer.group_scales[..., :16]) * scale_unit  # [N, G]
    offsets = per_row(layer.group_scales[..., 16:].contiguous().view(torch.int8)) * offset_unit  # [N, G]
    return (codes * scales[..., None] + offsets[..., None]).reshape(tiles * 16, groups * 32)


def test_packing_keeps_the_weight_within_half_a_step_and_flips_negative_scales():
    weight = torch.randn(32, 320, generator=torch.Generator().manual_seed(7)) * 0.05  # [N, K]: 10 groups, 2 blocks
    codes, scales, zeros = minmax_groups(weight, 32)
    negative = torch.zeros_like(scales, dtype=torch.bool)  # [N, G]
    negative[::3] = True
    # The same weights with negative scales: (q - 8) s + z = (q' - 8)(-s) + (z - s) with q' = 15 - q.
    flipped_codes = torch.where(negative.repeat_interleave(32, dim=1), 15 - codes, codes)
    flipped = (flipped_codes, torch.where(negative, -scales, scales), torch.where(negative, zeros - scales, zeros))
    for layer in (W4A8Linear.from_groups([(codes, scales, zeros)], None), W4A8Linear.from_groups([flipped], None)):
        step = scales.repeat_interleave(32, dim=1)  # [N, K]
        # Half a 4-bit step, plus 8-bit scale and offset codes: a few percent of a step more.
        assert ((unpacked_weight(layer) - weight).abs() <= 0.6 * step).all()


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded as the kernel rounds it: int8 per group of 32, scale max|x| / 127."""
    groups = x.reshape(len(x), -1, 32)  # [M, K/32, 32]
    scales = groups.abs().amax(-1, keepdim=True) / 127
    return (torch.round(groups / scales).clamp(-127, 127) * scales).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
@pytest.mark.parametrize("shape", [(48, 64), (256, 512)])
def test_kernel_equals_quantized_activations_times_its_weight(rows, shape):
    layer, weight = layer_and_weight(*shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows))  # [M, K]
    expected = quantized_activations(x) @ weight.t()  # [M, N]
    # Integer sums are exact; what differs is float32 rounding of the per-group scaling.
    assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-5)
    # Rounding activations to int8 costs little against the float activations: within 1% of the output scale.
    assert (layer(x) - x @ weight.t()).abs().max() < 0.01 * (x @ weight.t()).abs().max()


def kernel_inputs(rows: int, layer: W4A8Linear, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float32 and its activations as the kernel rounds them, in float64: per group of 32 the same
    float32 operations (scale max|x| / 127, codes round(x * (1 / scale))), then code * scale exactly."""
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(seed))  # [M, K]
    x[0, :32] = 0  # a group of zeros: scale 0, codes 0
    groups = x.reshape(rows, -1, 32)  # [M, G, 32]
    scales = groups.abs().amax(-1, keepdim=True) / 127  # [M, G, 1] float32
    inverse = torch.where(scales > 0, 1 / scales, 0)
    codes = torch.round(groups * inverse).clamp(-127, 127)  # [M, G, 32]
    return x, (codes.double() * scales.double()).reshape(rows, -1)


@pytest.mark.parametrize("isa", each_variant())
def test_each_variant_equals_a_float64_reference(isa):
    kernel = w4a8_linear.load_variant(isa)
    layer, weight = layer_and_weight(96, 768, seed=4)  # 24 groups, 3 blocks of scale units
    for rows in (1, 5, 8, 9):
        x, activations = kernel_inputs(rows, layer, seed=rows)
        expected = activations @ weight.double().t()  # [M, N]
        ours = kernel.w4a8_mm(x, layer.codes, layer.group_scales, layer.block_scales).double()
        # Integer sums are exact; float32 rounds each group's scaling and the running sum: a few ulps per group
        # of the terms' sizes, far below what a wrong code, scale or row would cost.
        bound = 2**-18 * (activations.abs() @ weight.double().abs().t())
        assert ((ours - expected).abs() <= bound).all(), (isa, rows)
        assert ours[0].abs().sum() > 0  # a row with a group of zeros still sums its other groups


@pytest.mark.parametrize("isa", each_variant())
def test_integer_sums_at_their_largest_stay_exact(isa):
    # Every code 15 and every activation +-127: AVX2 adds a group's products in int16 (vpmaddubsw), at most
    # 16 * 15 * 127 = 30480 there, in every row count's path; saturating or wrapping would be far off.
    kernel = w4a8_linear.load_variant(isa)
    layer, _ = layer_and_weight(32, 512, seed=7)
    layer.codes.fill_(0xFF)
    weight = unpacked_weight(layer).double()  # [N, K]
    signs = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0])  # [M]
    for rows in (1, 2, 3, 4, 5, 8, 9):
        x = signs[:rows, None].expand(rows, 512).contiguous()  # [M, K]: each group quantizes to +-127
        expected = x.double() @ weight.t()  # [M, N]
        ours = kernel.w4a8_mm(x, layer.codes, layer.group_scales, layer.block_scales).double()
        assert ((ours - expected).abs() <= 2**-18 * (x.double().abs() @ weight.abs().t())).all(), (isa, rows)


@pytest.mark.parametrize("first, second", [("avx512", "avx2"), ("avx512", "avx_vnni"), ("avx_vnni", "avx2")])
def test_variants_give_the_same_bits(first, second):
    flags = w4a8_linear.cpu_flags()
    missing = [flag for flag in dict.fromkeys(VARIANTS[first][0] + VARIANTS[second][0]) if flag not in flags]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)}, so it cannot run both {first} and {second}")
    layer, _ = layer_and_weight(96, 768, seed=5)
    x = torch.randn(19, 768, generator=torch.Generator().manual_seed(6))  # [M, K]
    for rows in (x[:1], x[:4], x):
        first_out, second_out = (w4a8_linear.load_variant(isa).w4a8_mm(rows, layer.codes, layer.group_scales,
                                                                       layer.block_scales) for isa in (first, second))
        assert torch.equal(first_out, second_out)


def test_the_variant_follows_the_cpu_flags_and_the_setting(monkeypatch):
    monkeypatch.delenv(ISA_SETTING, raising=False)
    zen3 = {"avx", "avx2", "fma", "f16c"}
    avx512 = zen3 | {"avx512f", "avx512bw", "avx512_vnni"}
    for flags, expected in ((avx512, "avx512"), (avx512 - {"avx512_vnni"}, "avx2"), (zen3 | {"avx_vnni"}, "avx_vnni"),
                            (zen3, "avx2"), (zen3 - {"fma"}, None), (set(), None)):
        monkeypatch.setattr(w4a8_linear, "cpu_flags", lambda flags=flags: flags)
        assert w4a8_linear.kernel_isa() == expected, flags
    monkeypatch.setattr(w4a8_linear, "cpu_flags", lambda: avx512)
    monkeypatch.setenv(ISA_SETTING, "avx2")
    assert w4a8_linear.kernel_isa() == "avx2"
    monkeypatch.setattr(w4a8_linear, "cpu_flags", lambda: zen3)
    monkeypatch.setenv(ISA_SETTING, "avx512")
    with pytest.raises(SpecDecodeError, match="SPECDECODE_W4A8_ISA=avx512: this CPU lacks avx512f, avx512bw, "
                                              "avx512_vnni; unset it"):
        w4a8_linear.kernel_isa()
    monkeypatch.setenv(ISA_SETTING, "avx3")
    with pytest.raises(SpecDecodeError, match="avx3: not a w4a8 kernel variant; use one of avx512, avx_vnni, avx2"):
        w4a8_linear.kernel_isa()


def test_cpu_features_are_read_on_linux_x86_linux_arm_and_macos(monkeypatch, tmp_path):
    monkeypatch.delenv(ISA_SETTING, raising=False)
    monkeypatch.setattr(cpu_features.sys, "platform", "linux")
    graviton = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes asimdrdm lrcpc dcpop asimddp\n"
    real_read_text = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: graviton if str(self) == "/proc/cpuinfo"
                        else real_read_text(self, *a, **k))
    assert "asimddp" in w4a8_linear.cpu_flags() and w4a8_linear.kernel_isa() == "neon"
    monkeypatch.setattr(cpu_features.sys, "platform", "darwin")
    apple_m1 = "hw.optional.floatingpoint: 1\nhw.optional.arm.FEAT_DotProd: 1\nhw.optional.arm.FEAT_I8MM: 0\n"
    intel_mac = "hw.optional.avx1_0: 1\nhw.optional.avx2_0: 1\nhw.optional.fma: 1\nhw.optional.avx512f: 0\n"
    for listing, expected in ((apple_m1, "neon"), (intel_mac, "avx2"), ("", None)):
        monkeypatch.setattr(cpu_features, "_read_command", lambda command, listing=listing: listing)
        assert w4a8_linear.kernel_isa() == expected, listing


def test_an_arm_cpu_without_the_dot_product_and_a_missing_compiler_are_one_line_each(monkeypatch):
    monkeypatch.setattr(w4a8_linear, "_kernel", None)  # as in a fresh process
    monkeypatch.delenv(ISA_SETTING, raising=False)
    monkeypatch.setattr(w4a8_linear.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(w4a8_linear, "cpu_flags", lambda: {"fp", "asimd"})  # a Raspberry Pi 4 (Cortex-A72)
    assert w4a8_linear.w4a8_unavailable() == "it needs a CPU with asimddp; this one lacks asimddp"
    monkeypatch.setattr(w4a8_linear, "cpu_flags", lambda: {"fp", "asimd", "asimddp"})
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(w4a8_linear.shutil, "which", lambda name: None if name == "no-such-compiler" else name)
    assert w4a8_linear.w4a8_unavailable() == (
        "compiling its kernel needs a C++ compiler (no-such-compiler; Debian or Ubuntu: apt install g++, Fedora: "
        "dnf install gcc-c++, macOS: xcode-select --install)")


def test_forcing_a_variant_this_cpu_cannot_run_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    monkeypatch.setattr(w4a8_linear, "_kernel", None)  # as in a fresh process
    monkeypatch.setattr(w4a8_linear, "cpu_flags", lambda: {"avx", "avx2", "fma"})
    monkeypatch.setenv(ISA_SETTING, "avx512")
    with pytest.raises(SpecDecodeError, match="SPECDECODE_W4A8_ISA=avx512: this CPU lacks avx512f"):
        load_model(folder, dtype="float32", quant="w4a8")


def test_each_row_gets_the_same_bits_alone_or_in_any_batch():
    layer, _ = layer_and_weight(64, 256, seed=1)
    x = torch.randn(19, 256, generator=torch.Generator().manual_seed(2))  # [M, K]
    together = layer(x)
    for start, stop in ((0, 1), (3, 11), (5, 19), (18, 19)):
        assert torch.equal(layer(x[start:stop]), together[start:stop])
    assert torch.equal(layer(x.reshape(1, 19, 256)).reshape(19, -1), together)  # 3-D input, same shape rules


def test_blocks_of_any_row_count_pack_like_the_whole():
    weight = torch.randn(80, 64, generator=torch.Generator().manual_seed(3))  # [N, K]
    whole = W4A8Linear.from_groups([minmax_groups(weight, 32)], None)
    blocks = zip(*(part.split([24, 40, 16]) for part in minmax_groups(weight, 32)))
    pieces = W4A8Linear.from_groups(blocks, None)
    for name in ("codes", "group_scales", "block_scales"):
        assert torch.equal(getattr(pieces, name), getattr(whole, name))


def test_w4a8_target_is_lossless_for_every_method(tmp_path):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    target = load_model(folder, dtype="bfloat16", quant="w4a8")
    assert not any(isinstance(m, torch.nn.Linear) for m in target.model.modules())
    engine = Engine(target, load_model(folder, dtype="bfloat16", quant="int4"))
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    for prompt in ("hello hello hello", "The quick brown fox"):
        plain = engine.complete(prompt, sampling, SpecConfig("none"))
        for method in ("ngram", "draft", "ngram,draft"):
            result = engine.complete(prompt, sampling, SpecConfig(method))
            assert result.token_ids == plain.token_ids, (prompt, method)
            assert result.stats.accepted_tokens > 0


def test_w4a8_from_gguf_keeps_q4_k_codes_and_reloads_from_the_cache(tmp_path, cache, monkeypatch):
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, num_hidden_layers=1)
    source = save_tiny_model(tmp_path / "hf", "qwen2", seed=5, tie_word_embeddings=False, **shape)
    path = tmp_path / "m.gguf"
    write_gguf(path, source, "qwen2", qtypes={"ffn_gate.weight": Q4_K, "ffn_up.weight": Q4_K,
                                              "ffn_down.weight": Q6_K})
    built = load_model(path, dtype="float32", quant="w4a8").model
    int4 = load_model(path, dtype="float32", quant="int4").model
    gate_up = built.layers[0].mlp.gate_up  # both halves Q4_K: the file's own codes
    assert isinstance(gate_up, W4A8Linear) and isinstance(int4.layers[0].mlp.gate_up, Int4Linear)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(6))  # [M, K]
    with torch.inference_mode():
        reference = int4.layers[0].mlp.gate_up(quantized_activations(x))  # same weights, same rounded inputs
        error = (gate_up(x) - reference).abs().max()
        # The file's 6-bit scales and mins, re-rounded to 8-bit codes per group and a bfloat16 unit per 256 inputs.
        assert error < 5e-3 * reference.abs().max()
    assert_reloads_from_the_cache(monkeypatch, path, "w4a8", built)


def assert_reloads_from_the_cache(monkeypatch, source: Path, quant: str, built: torch.nn.Module) -> None:
    """Loading `source` in `quant` again reads the cache, never builds, and gives `built`'s logits bit for bit."""

    def fail(*args, **kwargs):
        raise AssertionError(f"rebuilt although the {quant} model is cached")

    monkeypatch.setattr(quantized_model, "build_quantized", fail)
    cached = load_model(source, dtype="float32", quant=quant).model
    tokens = torch.arange(9).unsqueeze(0)  # [1, 9]
    with torch.inference_mode():
        logits = [m(tokens, torch.arange(9).unsqueeze(0), m.new_cache(9)).logits for m in (built, cached)]
    assert torch.equal(*logits)


def test_layers_the_kernel_cannot_tile_fall_back_to_int8(tmp_path):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    model = load_model(folder, dtype="float32", quant="w4a8").model
    kinds = {type(m) for m in model.modules() if isinstance(m, (W4A8Linear, Int8Linear))}
    assert W4A8Linear in kinds
    for module in model.modules():
        if isinstance(module, Int8Linear):
            assert module.out_features % 16 or module.weight.shape[1] % 32


def test_clear_errors_for_group_size_and_cpus_without_avx2(tmp_path, monkeypatch):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    with pytest.raises(SpecDecodeError, match="w4a8 uses groups of 32"):
        load_model(folder, dtype="float32", quant="w4a8", group_size=64)
    monkeypatch.setattr(w4a8_linear, "_kernel", None)  # as in a fresh process
    monkeypatch.delenv(ISA_SETTING, raising=False)
    monkeypatch.setattr(w4a8_linear, "cpu_flags", lambda: {"avx", "f16c"})
    with pytest.raises(SpecDecodeError, match=r"needs a CPU with avx2, fma \(or avx512f, avx512bw, avx512_vnni\); "
                                              "this one lacks avx2, fma; use --quant int4"):
        load_model(folder, dtype="float32", quant="w4a8")


def test_a_build_lock_left_by_an_interrupted_compile_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch, capsys):
    """torch waits for the lock to go: one left by a killed compile would hang every later start."""
    import os
    import time

    from specdecode.models.kernels.w4a8_linear import STALE_LOCK_SECONDS, clear_stale_build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "specdecode_w4a8_test" / "lock"
    assert not clear_stale_build_lock("specdecode_w4a8_test")  # none: nothing to do
    lock.touch()
    assert not clear_stale_build_lock("specdecode_w4a8_test") and lock.exists()  # another process compiling
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert clear_stale_build_lock("specdecode_w4a8_test") and not lock.exists()
    assert "interrupted compile" in capsys.readouterr().err
