"""Quantized models built straight from GGUF files and folders: each layer against gguf-py's own dequantization
of the file, the format each GGUF type becomes, the cache, and greedy identity with quantized drafts."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import linear_weight, save_tiny_model
from gguf_files import Q4_K, Q5_0, Q6_K, Q8_0, hf_weights, random_k_blocks, write_gguf

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models import loader, quantized_model
from specdecode.models.formats import weight_source
from specdecode.models.kernels.quantized_linear import Int4Linear, Int8Linear, minmax_groups, rows_in_multiples
from specdecode.models.loader import load_model
from specdecode.models.model_files import open_gguf_weights

# Inputs of 256 and 512 so every weight holds whole 256-weight K-quant blocks.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=2)
# A Q4_K_M-like mix: most tensors Q4_K, some at 6-8 bits, one Q5_0 (what the 0.5B draft uses).
TYPES = {"attn_q.weight": Q4_K, "attn_k.weight": Q4_K, "attn_v.weight": Q6_K, "attn_output.weight": Q5_0,
         "ffn_gate.weight": Q4_K, "ffn_up.weight": Q4_K, "blk.0.ffn_down.weight": Q6_K,
         "blk.1.ffn_down.weight": Q4_K, "token_embd.weight": Q8_0, "output.weight": Q8_0}


@pytest.fixture
def mixed_gguf(tmp_path, request):
    arch = getattr(request, "param", "qwen2")
    overrides = {"rope_scaling": None} if arch == "llama" else {}
    source = save_tiny_model(tmp_path / f"{arch}-hf", arch, seed=3, tie_word_embeddings=False, **SHAPE, **overrides)
    path = tmp_path / f"mixed-{arch}.gguf"
    write_gguf(path, source, arch, qtypes=TYPES)
    return path


def weight_of(layer: torch.nn.Module, in_features: int) -> torch.Tensor:
    """[N, K] float32: the layer applied to the identity is its weight, transposed (bias subtracted)."""
    with torch.inference_mode():
        out = layer(torch.eye(in_features))  # [K, N]
        if layer.bias is not None:
            out = out - layer.bias
    return out.t()


@pytest.mark.parametrize("mixed_gguf", ["qwen2", "llama"], indirect=True)
def test_int4_from_gguf_keeps_q4_k_exact_and_requantizes_the_rest(mixed_gguf):
    reference = load_model(mixed_gguf, dtype="float32", quant="none").model  # the file dequantized by gguf-py, q/k un-permuted
    model = load_model(mixed_gguf, dtype="float32", quant="int4").model
    float_layers = dict(reference.named_modules())
    exact = {"layers.0.mlp.gate_up", "layers.1.mlp.gate_up", "layers.1.mlp.down"}  # all sources Q4_K
    for name, layer in model.named_modules():
        if isinstance(layer, (Int8Linear, torch.nn.Linear)):
            raise AssertionError(f"{name} is not int4")
        if not isinstance(layer, Int4Linear):
            continue
        expected = linear_weight(float_layers[name])  # [N, K]
        got = weight_of(layer, expected.shape[1])
        if name in exact:
            assert torch.allclose(got, expected, atol=1e-6), name  # the file's own 4-bit values
        else:  # requantized (q/k Q4_K stacked with v Q6_K, Q5_0, Q6_K, Q8_0): half a step of each group's range
            groups = expected.reshape(expected.shape[0], -1, 32)  # [N, K/32, 32]
            step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
            assert ((got.reshape(groups.shape) - groups).abs() <= step / 2 + 1e-6).all(), name
    assert torch.equal(model.embed.weight, reference.embed.weight)  # looked up, never streamed: kept in float


def test_int8_from_gguf_stays_within_half_a_step_everywhere(mixed_gguf):
    reference = load_model(mixed_gguf, dtype="float32", quant="none").model
    model = load_model(mixed_gguf, dtype="float32", quant="int8").model
    float_layers = dict(reference.named_modules())
    for name, layer in model.named_modules():
        if isinstance(layer, (Int4Linear, torch.nn.Linear)):
            raise AssertionError(f"{name} is not int8")
        if isinstance(layer, Int8Linear):
            expected = linear_weight(float_layers[name])
            step = expected.abs().amax(dim=1, keepdim=True) / 127
            assert ((weight_of(layer, expected.shape[1]) - expected).abs() <= step / 2 + 1e-6).all(), name


def test_k_quant_blocks_decode_like_gguf_py(tmp_path):
    """Q4_K and Q6_K tensors of a written file, read back by our loader, equal gguf-py's dequantization."""
    path = tmp_path / "blocks.gguf"
    source = save_tiny_model(tmp_path / "hf", "qwen2", seed=4, tie_word_embeddings=False, **SHAPE)
    stored = write_gguf(path, source, "qwen2", qtypes=TYPES)
    model = load_model(path, dtype="float32", quant="none").model
    down_q6, down_q4 = stored["model.layers.0.mlp.down_proj.weight"], stored["model.layers.1.mlp.down_proj.weight"]
    assert (down_q6[1], down_q4[1]) == (Q6_K, Q4_K)
    for layer, (data, qtype) in zip(model.layers, (down_q6, down_q4)):
        expected = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
        assert torch.equal(linear_weight(layer.mlp.down), expected)


def test_quantized_model_is_cached_and_reloads_identically(mixed_gguf, cache, monkeypatch):
    first = load_model(mixed_gguf, dtype="bfloat16", quant="int4")
    assert first.folder.parent == cache / "quantized"
    assert not (cache / "converted").exists()  # built straight from the file, never through a float copy
    other = load_model(mixed_gguf, dtype="bfloat16", quant="int8")  # another mode is another cache entry
    assert other.folder != first.folder

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt although the quantized model is cached")

    monkeypatch.setattr(quantized_model, "build_quantized", fail)
    monkeypatch.setattr(loader, "open_gguf_weights", fail)  # nor is the file parsed: the config comes from the cache
    second = load_model(mixed_gguf, dtype="bfloat16", quant="int4")
    assert second.model.config == first.model.config
    tokens = torch.arange(12).unsqueeze(0)  # [1, 12]
    positions = torch.arange(12).unsqueeze(0)
    with torch.inference_mode():
        logits = [m.model(tokens, positions, m.model.new_cache(12)).logits for m in (first, second)]
    assert torch.equal(*logits)
    assert second.tokenizer.decode(second.tokenizer.encode("hello world")) == "hello world"
    assert sorted(p.name for p in first.folder.parent.iterdir()) == sorted([first.folder.name, other.folder.name])


def test_folder_source_quantizes_from_its_safetensors_and_caches(tmp_path, cache):
    folder = save_tiny_model(tmp_path / "hf", "llama", seed=6, scale=0.15)
    loaded = load_model(folder, dtype="float32", quant="int4", group_size=64)
    assert loaded.folder == folder  # tokenizer and config from the source folder
    assert [p.name for p in (cache / "quantized").iterdir()][0].endswith("int4-g64")
    weights = hf_weights(folder)
    expected = torch.from_numpy(weights["model.layers.0.mlp.down_proj.weight"])  # [N, K]
    got = weight_of(loaded.model.layers[0].mlp.down, expected.shape[1])
    groups = expected.reshape(expected.shape[0], -1, 64)
    step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15
    assert ((got.reshape(groups.shape) - groups).abs() <= step / 2 + 1e-6).all()


def test_gguf_quantized_draft_keeps_greedy_output_of_its_target(mixed_gguf):
    target = load_model(mixed_gguf, dtype="float32", quant="none")
    engine = Engine(target, load_model(mixed_gguf, dtype="bfloat16", quant="int4"))
    sampling = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = engine.complete("hello hello hello", sampling, SpecConfig("none"))
    result = engine.complete("hello hello hello", sampling, SpecConfig("draft"))
    assert result.token_ids == plain.token_ids
    assert 0 < result.stats.accepted_tokens <= result.stats.drafted_tokens


def test_random_k_blocks_are_valid_for_gguf_py():
    for qtype in (Q4_K, Q6_K):
        weights = gguf.quants.dequantize(random_k_blocks(qtype, 4, 512), qtype)  # [4, 512]
        assert weights.shape == (4, 512) and np.isfinite(weights).all() and 0 < np.abs(weights).max() < 1


def test_large_tensors_are_processed_in_row_chunks_with_the_same_result():
    from types import SimpleNamespace

    from specdecode.models.formats.gguf_read import dequantize_tensor

    rows = 4096 + 912  # more than one chunk of rows, and a ragged last one
    weight = torch.randn(rows, 64, generator=torch.Generator().manual_seed(0)) * 0.1  # [N, K]
    data = gguf.quants.quantize(weight.numpy(), Q8_0)
    tensor = SimpleNamespace(data=data, tensor_type=Q8_0)
    assert np.array_equal(dequantize_tensor(tensor), gguf.quants.dequantize(data, Q8_0))
    int8 = Int8Linear.from_weight(weight, None, torch.float32)
    scales = weight.abs().amax(dim=1) / 127  # [N]
    assert torch.equal(int8.scales, scales)
    assert torch.equal(int8.weight, torch.round(weight / scales[:, None]).to(torch.int8))
    int4 = Int4Linear.from_weight(weight, None, 32, torch.float32)
    assert torch.allclose(weight_of(int4, 64), weight, atol=float(weight.abs().max()) * 2 / 15 / 2 + 1e-6)
    with pytest.raises(SpecDecodeError, match="divisible by 16"):
        Int4Linear.from_weight(weight[:40], None, 32, torch.float32)


@pytest.mark.parametrize("quant", ["int4", "int8"])
@pytest.mark.parametrize("mixed_gguf", ["qwen2", "llama"], indirect=True)
def test_building_64_rows_at_a_time_gives_the_same_model(mixed_gguf, monkeypatch, quant):
    """The build reads blocks of rows, never a whole tensor in float32; the blocks' size must not matter."""
    def build() -> dict[str, torch.Tensor]:
        source = open_gguf_weights(mixed_gguf)
        model = quantized_model.build_quantized(source, source.config, mixed_gguf, torch.bfloat16, quant, 32, True)
        return model.state_dict()

    monkeypatch.setattr(weight_source, "_CHUNK_ELEMENTS", 1 << 40)  # every tensor in one block
    whole = build()
    monkeypatch.setattr(weight_source, "_CHUNK_ELEMENTS", 1)  # 64 rows per block
    read_rows = []
    original_get = weight_source.GGUFWeights.get

    def recording_get(self, name, rows=weight_source.ALL_ROWS):
        tensor = original_get(self, name, rows)
        read_rows.append(len(tensor) if tensor.ndim == 2 else 0)
        return tensor

    monkeypatch.setattr(weight_source.GGUFWeights, "get", recording_get)
    blocks = build()
    assert max(read_rows) == 64  # the embedding and head have 4x more rows
    assert whole.keys() == blocks.keys()
    for key in whole:
        assert torch.equal(whole[key], blocks[key]), key


@pytest.mark.parametrize("mixed_gguf", ["qwen2", "llama"], indirect=True)
def test_gguf_rows_read_alone_equal_the_same_rows_of_the_whole(mixed_gguf):
    source = open_gguf_weights(mixed_gguf)
    rows = slice(64, 192)
    for name in ("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                 "layers.0.self_attn.v_proj.weight", "embed_tokens.weight"):
        assert source.shape(name) == tuple(source.get(name).shape)
        assert torch.equal(source.get(name, rows), source.get(name)[rows]), name
    name = "layers.0.mlp.gate_proj.weight"
    for part, whole in zip(source.q4_k(name, rows), source.q4_k(name)):
        assert torch.equal(part, whole[rows])


def test_int4_blocks_pack_like_the_whole_whatever_their_row_counts():
    weight = torch.randn(64 * 3 + 48, 64, generator=torch.Generator().manual_seed(1))  # [N, K]
    whole = Int4Linear.from_weight(weight, None, 32, torch.float32)
    groups = minmax_groups(weight, 32)
    sizes = [48, 40, 24, 100, 28]  # none a multiple of 64: the layer regroups them before packing
    blocks = zip(*(part.split(sizes) for part in groups))
    layer = Int4Linear.from_groups(blocks, None, 32, torch.float32)
    assert torch.equal(layer.packed, whole.packed)
    assert torch.equal(layer.scales_and_zeros, whole.scales_and_zeros)


def test_rows_in_multiples_regroups_without_losing_or_reordering_rows():
    rows = torch.arange(23)
    blocks = [(part,) for part in rows.split([5, 3, 9, 6])]
    regrouped = [block[0] for block in rows_in_multiples(blocks, 4)]
    assert [len(b) for b in regrouped] == [4, 4, 8, 4, 3]
    assert torch.equal(torch.cat(regrouped), rows)
