"""Loading models: Hugging Face folders (single and sharded), GGUF files (quantized, converted once and cached),
and one clear SpecDecodeError for each way a user can point us at something broken."""

from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import CHAT_TEMPLATE, TINY_VOCAB, byte_tokenizer, save_tiny_model
from safetensors import safe_open

from specdecode.errors import SpecDecodeError
from specdecode.models import loader
from specdecode.models.loader import load_model

# Same op-order rounding budget as tests/test_transformer.py: both sides fp32 on identical weights.
LOGITS_ATOL = 1e-4
Q8_0, F16, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
TEXT = "Hello world: café, 世界 and 🙂!"

# Hugging Face name (after "model.layers.N.") -> GGUF name and the type we store it as: a realistic mix of
# lossy Q8_0 and lossless F16/F32, as llama.cpp's converter writes (norms and biases stay F32).
_BLOCK = {
    "input_layernorm.weight": ("attn_norm.weight", F32),
    "self_attn.q_proj.weight": ("attn_q.weight", F16),
    "self_attn.k_proj.weight": ("attn_k.weight", Q8_0),
    "self_attn.v_proj.weight": ("attn_v.weight", Q8_0),
    "self_attn.q_proj.bias": ("attn_q.bias", F32),
    "self_attn.k_proj.bias": ("attn_k.bias", F32),
    "self_attn.v_proj.bias": ("attn_v.bias", F32),
    "self_attn.o_proj.weight": ("attn_output.weight", F16),
    "post_attention_layernorm.weight": ("ffn_norm.weight", F32),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q8_0),
    "mlp.up_proj.weight": ("ffn_up.weight", F16),
    "mlp.down_proj.weight": ("ffn_down.weight", Q8_0),
}
_GLOBAL = {
    "model.embed_tokens.weight": ("token_embd.weight", Q8_0),
    "model.norm.weight": ("output_norm.weight", F32),
    "lm_head.weight": ("output.weight", F16),
}


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to llama q/k rows (LlamaModel.permute): interleave the rotary halves."""
    return (weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama3_rope_factors(scaling: dict, head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs tensor for llama3 scaling (transformers 5's rope_parameters)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (scaling["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def hf_weights(folder: Path) -> dict[str, np.ndarray]:
    with safe_open(str(folder / "model.safetensors"), framework="np") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def gguf_tokens() -> tuple[list[str], list[int], list[str]]:
    """The conftest byte vocabulary (same ids) plus two merges, padded to the embedding size like Qwen's files."""
    vocab = byte_tokenizer().get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    types = [int(gguf.TokenType.CONTROL if token.startswith("<|") else gguf.TokenType.NORMAL) for token in tokens]
    merges = ["Ġ t", "h e"]
    for merged in ("Ġt", "he"):
        tokens.append(merged)
        types.append(int(gguf.TokenType.NORMAL))
    while len(tokens) < TINY_VOCAB:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(int(gguf.TokenType.UNUSED))
    return tokens, types, merges


def write_gguf(path: Path, hf_folder: Path, arch: str, quantized: bool = True,
               rope_factors: np.ndarray | None = None) -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """Writes `hf_folder`'s model as a GGUF file the way llama.cpp's converter would.

    Returns HF name -> (the array stored in the file, its type), to check the conversion against.
    """
    config = json.loads((hf_folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    tokens, types, merges = gguf_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))  # like Qwen's files: <|im_end|> must come from the vocab
    writer.add_chat_template(CHAT_TEMPLATE)

    stored = {}
    for name, weight in hf_weights(hf_folder).items():
        if name in _GLOBAL:
            gguf_name, qtype = _GLOBAL[name]
        else:
            _, _, block, rest = name.split(".", 3)
            gguf_name, qtype = _BLOCK[rest]
            gguf_name = f"blk.{block}.{gguf_name}"
        if arch == "llama" and ".attn_q." in gguf_name:
            weight = llama_cpp_permute(weight, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            weight = llama_cpp_permute(weight, kv_heads)
        if not quantized or weight.ndim == 1:
            qtype = F32
        data = gguf.quants.quantize(weight.astype(np.float32), qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        stored[name] = (data, qtype)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors, raw_dtype=F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(path))
    return path


@torch.no_grad()
def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return reference(tokens).logits.float()


@torch.no_grad()
def our_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), model.new_cache(tokens.shape[1])).logits


def sample_tokens(length: int = 20) -> torch.Tensor:
    return torch.randint(0, TINY_VOCAB, (1, length), generator=torch.Generator().manual_seed(0))


# --- Hugging Face folders ---------------------------------------------------------------------------------


def test_hf_folder_loads_model_and_tokenizer(tiny_models):
    loaded = load_model(tiny_models["qwen2"], dtype="float32")
    assert loaded.folder == tiny_models["qwen2"]
    assert loaded.config.architecture == "qwen2" and loaded.config.qkv_bias
    assert loaded.model.dtype == torch.float32
    assert loaded.tokenizer.decode(loaded.tokenizer.encode(TEXT)) == TEXT
    tokens = sample_tokens()
    torch.testing.assert_close(our_logits(loaded.model, tokens), hf_logits(loaded.folder, tokens),
                               atol=LOGITS_ATOL, rtol=0)


def test_sharded_hf_folder_loads_the_same_weights(tmp_path, tiny_models):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.float32)
    model.save_pretrained(str(sharded), max_shard_size="40KB")
    byte_tokenizer().save_pretrained(str(sharded))
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 2
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert {p.name for p in shards} == set(index["weight_map"].values())

    whole = load_model(tiny_models["llama"], dtype="float32").model.state_dict()
    split = load_model(sharded, dtype="float32").model.state_dict()
    assert whole.keys() == split.keys()
    for key in whole:
        assert torch.equal(whole[key], split[key]), key


# --- GGUF files ---------------------------------------------------------------------------------------------


def unpermute_reference(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of llama_cpp_permute, written independently: interleaved rotary pairs back to two halves."""
    rows = weights.shape[0]
    half = rows // heads // 2
    order = [h * 2 * half + 2 * i + part for h in range(heads) for part in (0, 1) for i in range(half)]
    return weights[torch.tensor(order)]


def check_converted_weights(folder: Path, stored: dict, original: dict[str, np.ndarray], arch: str, config) -> None:
    """Converted = gguf.quants.dequantize(what was written), un-permuted; and close to the original weights."""
    converted = hf_weights(folder)
    assert set(stored) <= set(converted)
    for name, (data, qtype) in stored.items():
        expected = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32))
        if arch == "llama" and "q_proj" in name:
            expected = unpermute_reference(expected, config.num_heads)
        elif arch == "llama" and "k_proj" in name:
            expected = unpermute_reference(expected, config.num_kv_heads)
        got = torch.from_numpy(converted[name])
        assert torch.equal(got, expected), name
        # Q8_0 keeps each weight within half a step (step = its 32-weight block's max|w| / 127).
        # Weights are N(0, 0.3), so block maxima stay under ~4.5 sigma: half a step is < 0.3 * 4.5 / 254.
        budget = {Q8_0: 0.3 * 4.5 / 254 * 2, F16: 2e-3, F32: 0.0}[qtype]
        torch.testing.assert_close(got, torch.from_numpy(original[name]), atol=budget, rtol=0, msg=name)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_quantized_gguf_loads_and_matches_transformers_on_the_dequantized_weights(tmp_path, arch):
    # llama: no rope scaling here, since transformers cannot read a rope_freqs tensor (see the test below).
    overrides = {"rope_scaling": None} if arch == "llama" else {}
    source = save_tiny_model(tmp_path / f"{arch}-hf", arch, seed=5, **overrides)
    path = tmp_path / f"tiny-{arch}.gguf"
    stored = write_gguf(path, source, arch)
    assert {qtype for _, qtype in stored.values()} == {Q8_0, F16, F32}

    loaded = load_model(path, dtype="float32")
    config = loaded.config
    assert config.architecture == arch
    assert (config.num_heads, config.num_kv_heads, config.vocab_size) == (4, 2, TINY_VOCAB)
    assert config.qkv_bias == (arch == "qwen2")
    assert loaded.folder.parent == tmp_path / "cache" / "converted"
    check_converted_weights(loaded.folder, stored, hf_weights(source), arch, config)

    tokens = sample_tokens()
    torch.testing.assert_close(our_logits(loaded.model, tokens), hf_logits(loaded.folder, tokens),
                               atol=LOGITS_ATOL, rtol=0)

    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.hf.convert_tokens_to_ids("he") in tokenizer.encode("the")  # the merges were kept
    assert tokenizer.hf.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids
    assert tokenizer.hf.convert_tokens_to_ids("<|endoftext|>") in tokenizer.eos_token_ids
    assert tokenizer.has_chat_template
    prompt = tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert tokenizer.hf.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_llama3_gguf_rope_freqs_give_the_scaled_model(tmp_path, tiny_models):
    """llama3 scaling travels in GGUF as a rope_freqs tensor: ours must then equal the HF llama3-config model."""
    source = tiny_models["llama"]
    config = json.loads((source / "config.json").read_text())
    scaling = config["rope_parameters"]
    assert scaling["rope_type"] == "llama3"
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    path = tmp_path / "llama3.gguf"
    write_gguf(path, source, "llama", quantized=False, rope_factors=llama3_rope_factors(scaling, head_dim))
    loaded = load_model(path, dtype="float32")
    tokens = sample_tokens(40)
    torch.testing.assert_close(our_logits(loaded.model, tokens), hf_logits(source, tokens),
                               atol=LOGITS_ATOL, rtol=0)


def test_gguf_conversion_is_cached(tmp_path, tiny_models, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_models["qwen2"], "qwen2")
    first = load_model(path, dtype="float32")

    def fail(*args, **kwargs):
        raise AssertionError("convert_gguf called although a converted folder is cached")

    monkeypatch.setattr(loader, "convert_gguf", fail)
    second = load_model(path, dtype="float32")
    assert second.folder == first.folder
    tokens = sample_tokens()
    torch.testing.assert_close(our_logits(second.model, tokens), our_logits(first.model, tokens))
    assert not [p for p in first.folder.parent.iterdir() if p != first.folder]  # no staging folder left


# --- Bad input: one clear SpecDecodeError each --------------------------------------------------------------


def test_unknown_model_name_is_rejected():
    with pytest.raises(SpecDecodeError, match="unknown model 'no-such-model'.*default name"):
        load_model("no-such-model", dtype="float32")


def test_folder_without_config_is_rejected(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(SpecDecodeError, match="no config.json"):
        load_model(tmp_path, dtype="float32")


def test_file_that_is_neither_gguf_nor_folder_is_rejected(tmp_path):
    path = tmp_path / "weights.txt"
    path.write_text("hello")
    with pytest.raises(SpecDecodeError, match="neither a .gguf file nor a model folder"):
        load_model(path, dtype="float32")


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(SpecDecodeError, match="unsupported architecture 'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_model(tmp_path, dtype="float32")


def test_unsupported_gguf_architecture_lists_the_supported_ones(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(SpecDecodeError, match="unsupported architecture 'falcon'.*llama, mistral, qwen2, qwen3"):
        load_model(path, dtype="float32")


def test_pickled_weights_are_refused_and_never_unpickled(tmp_path, tiny_models):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(tiny_models["qwen2"] / "config.json", folder)
    marker = tmp_path / "unpickled"

    class TouchOnLoad:  # unpickling this creates `marker`: proof that the file was (not) unpickled
        def __reduce__(self):
            return Path.touch, (marker,)

    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(TouchOnLoad()))
    with pytest.raises(SpecDecodeError, match="no \\*.safetensors.*pytorch_model.bin.*never loaded"):
        load_model(folder, dtype="float32")
    assert not marker.exists()


def test_truncated_safetensors_is_reported(tmp_path, tiny_models):
    folder = tmp_path / "truncated"
    shutil.copytree(tiny_models["qwen2"], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(SpecDecodeError, match="model.safetensors is corrupt or truncated"):
        load_model(folder, dtype="float32")


@pytest.mark.parametrize("keep", [0.6, 0.01], ids=["in-tensor-data", "in-header"])
def test_truncated_gguf_is_reported(tmp_path, tiny_models, keep):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_models["qwen2"], "qwen2")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(SpecDecodeError, match="tiny.gguf is truncated"):
        load_model(path, dtype="float32")
    assert not (tmp_path / "cache" / "converted").exists() or not any((tmp_path / "cache" / "converted").iterdir())


def test_non_gguf_file_with_gguf_suffix_is_reported(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"<html>not a model</html>" * 100)
    with pytest.raises(SpecDecodeError, match="fake.gguf is not a GGUF file"):
        load_model(path, dtype="float32")


def test_invalid_dtype_lists_the_choices(tiny_models):
    with pytest.raises(SpecDecodeError, match="unknown dtype 'float64'.*auto.*bfloat16.*float32"):
        load_model(tiny_models["qwen2"], dtype="float64")
