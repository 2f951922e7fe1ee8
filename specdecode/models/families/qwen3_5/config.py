"""Qwen 3.5 / 3.6's config, dense or MoE (experts in every layer, a gated shared expert beside them): Gated DeltaNet and gated full-attention layers, zero-centred norms, partial
rotary (its multimodal rope is plain rope for text: every section reads the same position), read from config.json
(text-only and multimodal checkpoints; Qwen 3.6 dense ships as qwen3_5) and written back as transformers reads it."""

from __future__ import annotations

from specdecode.models.decoder.moe import MoEConfig
from specdecode.models.model_config import ModelConfig, eos_ids, rope_theta

MODEL_TYPES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
               "qwen3_5_moe_text": "qwen3_5_moe"}


def from_hf(hf: dict, model_type: str) -> ModelConfig:
    num_heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    interval = hf.get("full_attention_interval", 4)
    layer_types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    mtp = hf.get("mtp_num_hidden_layers") or 0
    moe = None
    if MODEL_TYPES[model_type] == "qwen3_5_moe":  # every layer's MLP: experts (always renormalised), a gated shared one
        moe = MoEConfig(num_experts=hf["num_experts"], experts_per_token=hf["num_experts_per_tok"],
                        expert_size=hf["moe_intermediate_size"], renormalize=True,
                        shared_size=hf["shared_expert_intermediate_size"], shared_gate=True, shared_name="shared_expert")
    return ModelConfig(
        architecture=MODEL_TYPES[model_type], vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        # a MoE model has no dense MLP: its width is unused, the shared expert's stands in
        intermediate_size=hf.get("intermediate_size") or hf["shared_expert_intermediate_size"], num_layers=layers, num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=rope_theta(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True, bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
        mtp_layers=mtp, mtp_declared=mtp, mtp_layout="top_level", layer_types=tuple(layer_types),
        linear_num_key_heads=hf["linear_num_key_heads"], linear_num_value_heads=hf["linear_num_value_heads"],
        linear_key_head_dim=hf["linear_key_head_dim"], linear_value_head_dim=hf["linear_value_head_dim"],
        linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4), rotary_dim=int(head_dim * partial) // 2 * 2,
        attn_output_gate=True, zero_centred_norms=True, moe=moe)


def to_hf(config: ModelConfig) -> dict:
    moe = config.moe
    experts = {} if moe is None else {
        "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token, "moe_intermediate_size": moe.expert_size,
        "shared_expert_intermediate_size": moe.shared_size}
    return config.common_hf() | {
        "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"], "attention_bias": config.qkv_bias,
        "layer_types": list(config.layer_types), "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads, "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim, "linear_conv_kernel_dim": config.linear_conv_kernel,
        "hidden_act": "silu", "mtp_num_hidden_layers": config.mtp_layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                            "partial_rotary_factor": config.rotary_dim / config.head_dim}} | experts
