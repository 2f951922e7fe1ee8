"""Model families are registered like drafters (models/families/): a family written in this file alone loads and
runs through the loader, the kernels and the engine, and no module outside models/families/ names a family."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import ROOT, save_tiny_model
from safetensors.torch import load_file, save_file

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.models.batch_invariance import batch_invariant
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.families import FAMILIES, ModelFamily, register_family
from specdecode.models.formats.layer_names import block_shapes
from specdecode.models.kernels.float_decoder import fix_float_layers, float_batch_invariant
from specdecode.models.kernels.w4a8_decoder import fuse_layers, fused_batch_invariant
from specdecode.models.loader import load_model
from specdecode.models.model_config import ModelConfig

PACKAGE = ROOT / "specdecode"
# A toy checkpoint's names for a Llama-style layer's tensors -> Hugging Face's (after "model.layers.N.")
TOY_NAMES = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
             "norm_attn": "input_layernorm", "norm_ffn": "post_attention_layernorm"}


class ToyFamily(ModelFamily):
    """A family declared here alone: a Llama-style trunk whose config.json and tensors name things their own way
    (d_model, blocks.N.wq, ...). It reads through the shared layers; nothing outside this file knows it."""

    name = "toy"
    model_types = {"toy_lm": "toy_lm"}

    def config_from_hf(self, hf: dict, model_type: str) -> ModelConfig:
        return ModelConfig(architecture="toy_lm", vocab_size=hf["n_vocab"], hidden_size=hf["d_model"],
                           intermediate_size=hf["d_ff"], num_layers=hf["n_layers"], num_heads=hf["n_heads"],
                           num_kv_heads=hf["n_kv_heads"], head_dim=hf["d_model"] // hf["n_heads"],
                           max_position_embeddings=hf["n_ctx"], eos_token_ids=(257,))

    def config_to_hf(self, config: ModelConfig) -> dict:
        return {"model_type": "toy_lm", "n_vocab": config.vocab_size, "d_model": config.hidden_size,
                "d_ff": config.intermediate_size, "n_layers": config.num_layers, "n_heads": config.num_heads,
                "n_kv_heads": config.num_kv_heads, "n_ctx": config.max_position_embeddings}

    def sources(self, config: ModelConfig) -> dict[str, list[str]]:
        found = {"embed.weight": ["tok_embeddings"], "norm.weight": ["final_norm"], "lm_head.weight": ["unembed"]}
        for i in range(config.num_layers):
            block = f"blocks.{i}."
            found |= {f"layers.{i}.attn_norm.weight": [block + "norm_attn"],
                      f"layers.{i}.mlp_norm.weight": [block + "norm_ffn"],
                      f"layers.{i}.attn.qkv.weight": [block + "wq", block + "wk", block + "wv"],
                      f"layers.{i}.attn.o.weight": [block + "wo"],
                      f"layers.{i}.mlp.gate_up.weight": [block + "w_gate", block + "w_up"],
                      f"layers.{i}.mlp.down.weight": [block + "w_down"]}
        return found

    def shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        hidden = config.hidden_size
        shapes = {"tok_embeddings": (config.vocab_size, hidden), "unembed": (config.vocab_size, hidden),
                  "final_norm": (hidden,)}
        layer = block_shapes(config)
        for i in range(config.num_layers):
            shapes |= {f"blocks.{i}.{toy}": layer[f"{hf}.weight"] for toy, hf in TOY_NAMES.items()}
        return shapes

    def build(self, config: ModelConfig) -> Transformer:
        return Transformer(config)

    def fuse_w4a8(self, model: Transformer) -> None:
        fuse_layers(model)

    def fix_float(self, model: Transformer) -> str | None:
        return fix_float_layers(model)

    def batch_invariant(self, model: Transformer) -> bool:
        return fused_batch_invariant(model) or float_batch_invariant(model)


@pytest.fixture(scope="module")
def toy_family():
    family = register_family(ToyFamily())
    yield family
    del FAMILIES[family.name]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(a tiny Llama model's folder, the same weights in the toy family's layout)."""
    root = tmp_path_factory.mktemp("toy")
    llama = save_tiny_model(root / "llama", "llama", scale=0.15, rope_scaling=None, tie_word_embeddings=False)
    hf = json.loads((llama / "config.json").read_text())
    toy = root / "toy"
    toy.mkdir()
    config = {"model_type": "toy_lm", "n_vocab": hf["vocab_size"], "d_model": hf["hidden_size"],
              "d_ff": hf["intermediate_size"], "n_layers": hf["num_hidden_layers"],
              "n_heads": hf["num_attention_heads"], "n_kv_heads": hf["num_key_value_heads"],
              "n_ctx": hf["max_position_embeddings"]}
    (toy / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(llama / "model.safetensors"))
    renamed = {"tok_embeddings": tensors["model.embed_tokens.weight"], "final_norm": tensors["model.norm.weight"],
               "unembed": tensors["lm_head.weight"]}
    for i in range(hf["num_hidden_layers"]):
        renamed |= {f"blocks.{i}.{toy_name}": tensors[f"model.layers.{i}.{name}.weight"]
                    for toy_name, name in TOY_NAMES.items()}
    save_file(renamed, str(toy / "model.safetensors"))
    for file in llama.iterdir():  # the tokenizer
        if file.name.startswith(("tokenizer", "special_tokens", "generation")):
            (toy / file.name).write_bytes(file.read_bytes())
    return llama, toy


def test_a_family_registered_in_a_test_file_loads_and_runs(toy_family, checkpoints):
    """The toy family's checkpoint is the Llama model's weights under other names: loaded through the registry it
    computes the same logits, bit for bit, and speculative decoding over it is plain decoding's output."""
    llama_folder, toy_folder = checkpoints
    llama, toy = load_model(llama_folder, dtype="float32"), load_model(toy_folder, dtype="float32")
    assert toy.config.architecture == "toy_lm"
    tokens = torch.tensor([[1, 5, 9, 200, 31, 7]])  # [1, T]
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)  # [1, T]
    with torch.inference_mode():
        expected = llama.model(tokens, positions, llama.model.new_cache(8)).logits
        got = toy.model(tokens, positions, toy.model.new_cache(8)).logits
    assert torch.equal(got, expected)
    engine = Engine(toy)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = engine.complete("abcabc abcabc", sampling, SpecConfig("none")).token_ids
    assert engine.complete("abcabc abcabc", sampling, SpecConfig("ngram")).token_ids == plain


def test_a_registered_family_runs_on_the_shared_kernels(toy_family, checkpoints):
    """Quantized to w4a8 through the family's tensor maps, its layers fuse on the shared kernel: batch-invariant,
    as the Llama family's are."""
    toy = load_model(checkpoints[1], dtype="bfloat16", quant="w4a8")
    assert batch_invariant(toy.model)


def test_a_model_type_two_families_claim_is_refused(toy_family):
    class Squatter(ToyFamily):
        name = "squatter"

    with pytest.raises(ValueError, match="toy_lm"):
        register_family(Squatter())
    assert "squatter" not in FAMILIES


def family_names_outside_their_folders() -> list[str]:
    """Lines outside models/families/ that name a family: an `is_<family>` flag, or a quoted model type, GGUF
    architecture or family name of a registered family. The Llama
    family's names are exempt: they are the shared Llama-style decoder's (decoder/llama_config.py), which every
    drafter head (EAGLE-3, DFlash, DSpark) declares its layers as."""
    names = {name for family in FAMILIES.values() if family.name != "llama"
             for name in (family.name, *family.model_types, *family.gguf_architectures, *family.not_supported)}
    quoted = re.compile(r"[\"'](" + "|".join(re.escape(name) for name in sorted(names)) + r")[\"']")
    flags = re.compile(r"\bis_(hybrid|gemma|moe|mla)\b")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "families" in path.relative_to(PACKAGE).parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if quoted.search(line) or flags.search(line):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    return found


def test_no_module_outside_models_families_names_a_family():
    assert family_names_outside_their_folders() == []
