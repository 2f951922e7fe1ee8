"""Qwen3-MoE's config (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): Qwen3's attention (q/k norms, full
rope) over a mixture of experts routed by a softmax, read from config.json or a `qwen3moe` GGUF file's metadata
and written back as transformers reads it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from specdecode.models.decoder import llama_config
from specdecode.models.decoder.moe import MoEConfig, dense_layers
from specdecode.models.model_config import ModelConfig

MODEL_TYPES = {"qwen3_moe": "qwen3_moe"}
GGUF_ARCHITECTURE = "qwen3moe"


def from_hf(hf: dict, model_type: str) -> ModelConfig:
    layers = hf["num_hidden_layers"]
    # Published configs say num_experts; transformers 5 writes its alias num_local_experts.
    moe = MoEConfig(num_experts=hf.get("num_experts") or hf["num_local_experts"], experts_per_token=hf["num_experts_per_tok"],
                    expert_size=hf["moe_intermediate_size"],
                    dense_layers=dense_layers(layers, hf.get("mlp_only_layers") or [], hf.get("decoder_sparse_step", 1)),
                    renormalize=bool(hf.get("norm_topk_prob", False)))
    # Its attention and sizes are Qwen3's, read as the shared Llama-style decoder reads them.
    return replace(llama_config.from_hf(hf, "qwen3"), architecture="qwen3_moe", moe=moe)


def to_hf(config: ModelConfig) -> dict:
    moe = config.moe
    return config.common_hf() | {
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": config.qkv_bias,
        "num_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
        "moe_intermediate_size": moe.expert_size, "norm_topk_prob": moe.renormalize,
        "mlp_only_layers": list(moe.dense_layers), "decoder_sparse_step": 1}


def from_gguf(meta, tensors: dict, tokens: dict, path: Path) -> ModelConfig:
    """From a qwen3moe file's metadata (`meta(key, default)`) and tensor names. llama.cpp runs every layer sparse
    and always renormalises the k weights (its qwen3moe graph), so a file is run as llama.cpp runs it."""
    moe = MoEConfig(num_experts=int(meta("expert_count")), experts_per_token=int(meta("expert_used_count")),
                    expert_size=int(meta("expert_feed_forward_length")), renormalize=True)
    return replace(llama_config.from_gguf(meta, "qwen3", tensors, tokens, path), architecture="qwen3_moe", moe=moe)
