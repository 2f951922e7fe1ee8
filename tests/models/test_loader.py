"""Loading models: Hugging Face folders (single and sharded), GGUF files (quantized, converted once and cached),
and one clear SpecDecodeError for each way a user can point us at something broken."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, byte_tokenizer, save_tiny_model
from gguf_files import F16, F32, Q8_0, hf_weights, llama3_rope_factors, write_gguf

from specdecode.errors import SpecDecodeError
from specdecode.models import loader
from specdecode.models.loader import load_model
from specdecode.models.model_files import parameter_count

# Same op-order rounding budget as tests/models/test_transformer.py: both sides fp32 on identical weights.
LOGITS_ATOL = 1e-4
TEXT = "Hello world: café, 世界 and 🙂!"

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


def test_a_gguf_file_beside_other_tokenizer_files_keeps_its_own_chat_template(tmp_path, tiny_models):
    """transformers would read the folder's tokenizer files instead of the file's metadata and lose the template."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_models["llama"], "llama")
    plain = byte_tokenizer()
    plain.chat_template = None
    plain.save_pretrained(str(tmp_path))  # tokenizer.json and tokenizer_config.json without a template
    assert load_model(path, dtype="float32").tokenizer.hf.chat_template is not None


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


def test_weights_bytes_counts_prepacked_bf16_weights(tiny_models):
    """oneDNN's prepacked linears are no module state; the memory they hold is counted all the same."""
    model = load_model(tiny_models["qwen2"], dtype="bfloat16")
    assert model.weights_bytes >= 2 * parameter_count(model.config)  # every tensor, in bf16
    assert model.weights_bytes < 2.1 * parameter_count(model.config)
