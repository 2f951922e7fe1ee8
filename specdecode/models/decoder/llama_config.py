"""The config of the Llama-style decoder (layers.py): the Llama family's trunks (Llama 2/3, Mistral, Qwen2/2.5,
Qwen3, and MiMo: a Qwen2 trunk with MTP layers, families/llama) and every drafter head built from its layers
(EAGLE-3, DFlash, DSpark: formats/), read from config.json or a GGUF file's metadata, and written back as
transformers reads it. It lives with the shared layer rather than in the family's folder because those heads
read it too."""

from __future__ import annotations

from pathlib import Path

from specdecode.models.model_config import ModelConfig, eos_ids, rope_scaling, rope_theta

# config.json's model_type -> our architecture; MiMo is a Qwen2 trunk with MTP layers under its own names.
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "mimo": "qwen2"}
# GGUF calls Mistral "llama"; both share one decoder here.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM"}


def from_hf(hf: dict, model_type: str) -> ModelConfig:
    arch = MODEL_TYPES[model_type]
    num_heads = hf["num_attention_heads"]
    attention_bias = bool(hf.get("attention_bias", False))
    use_window = hf.get("use_sliding_window", arch == "mistral")
    return ModelConfig(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta(hf),
        rope_scaling=rope_scaling(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if arch == "qwen2" else attention_bias,
        o_bias=attention_bias and arch != "qwen2",
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=arch == "qwen3",
        sliding_window=hf.get("sliding_window") if use_window else None,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
        # Present until the loader finds otherwise (loader.read_config looks at the weights' names).
        mtp_layers=hf.get("num_nextn_predict_layers") or 0,
        mtp_declared=hf.get("num_nextn_predict_layers") or 0,
        mtp_layout="mimo" if model_type == "mimo" else "deepseek",
    )


def to_hf(config: ModelConfig) -> dict:
    hf = config.common_hf() | {"model_type": config.architecture, "architectures": [HF_CLASSES[config.architecture]]}
    if config.architecture != "qwen2":
        hf["attention_bias"] = config.qkv_bias
    if config.mtp_layers:
        hf["num_nextn_predict_layers"] = config.mtp_layers  # the layers written with it
        if config.mtp_layout == "mimo":  # MiMo is a Qwen2 trunk with MTP layers under its own names
            hf["model_type"], hf["architectures"] = "mimo", ["MiMoForCausalLM"]
    return hf


def from_gguf(meta, architecture: str, tensors: dict, tokens: dict, path: Path) -> ModelConfig:
    """From a llama/qwen2/qwen3 GGUF file's metadata (`meta(key, default)`) and tensor names."""
    hidden = int(meta("embedding_length"))
    # llama.cpp counts the MTP blocks in block_count; the trunk is the blocks before them.
    nextn = int(meta("nextn_predict_layers", 0))
    trunk_layers = int(meta("block_count")) - nextn
    mtp_present = nextn if f"blk.{trunk_layers}.nextn.eh_proj.weight" in tensors else 0
    heads = int(meta("attention.head_count"))
    eos = tokens.get("eos")
    scaling = None
    if meta("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    return ModelConfig(
        architecture=GGUF_ARCHITECTURES[architecture],
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_layers=trunk_layers,
        num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=int(meta("attention.key_length", hidden // heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        mlp_bias="blk.0.ffn_down.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=tokens.get("bos"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        mtp_layers=mtp_present,
        mtp_declared=nextn,
    )
