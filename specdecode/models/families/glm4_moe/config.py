"""GLM-4.5 / 4.6 / Air's config (`glm4_moe`): grouped-query attention with q, k and v biases (no output bias), q/k
norms where `use_qk_norm` says, rope on the first `partial_rotary_factor` of each head (0.5 by default), the first
`first_k_dense_replace` layers dense and the rest a mixture of experts routed by sigmoid scores with a correction
bias, renormalised and scaled, one shared expert beside them; and its MTP layer(s) (`num_nextn_predict_layers`)
after the trunk's, in DeepSeek's layout, whose block is itself sparse. Read from config.json and written back as
transformers reads it."""

from __future__ import annotations

from specdecode.models.decoder.moe import MoEConfig, dense_layers
from specdecode.models.formats.gguf_read import stored_float
from specdecode.models.model_config import ModelConfig, eos_ids, rope_scaling, rope_theta

MODEL_TYPES = {"glm4_moe": "glm4_moe"}
GGUF_ARCHITECTURE = "glm4moe"


def from_hf(hf: dict, model_type: str) -> ModelConfig:
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))
    # transformers 5 writes num_nextn_predict_layers; num_mtp_layers is its alias
    mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0
    expert_size = hf["moe_intermediate_size"]
    moe = MoEConfig(num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
                    experts_per_token=hf["num_experts_per_tok"], expert_size=expert_size,
                    dense_layers=dense_layers(layers, first_dense=hf.get("first_k_dense_replace", 1)),
                    scoring="sigmoid", score_bias=True, groups=hf.get("n_group", 1), groups_kept=hf.get("topk_group", 1),
                    renormalize=bool(hf.get("norm_topk_prob", True)),
                    scaling=float(hf.get("routed_scaling_factor", 1.0)), float32_router=True,
                    shared_size=expert_size * hf.get("n_shared_experts", 1))
    return ModelConfig(
        architecture="glm4_moe", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=layers, num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=rope_theta(hf), rope_scaling=rope_scaling(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=bool(hf.get("use_qk_norm", False)),
        bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids(hf),
        mtp_layers=mtp, mtp_declared=mtp, mtp_layout="deepseek", rotary_dim=int(head_dim * partial) // 2 * 2, moe=moe)


def from_gguf(meta, tensors: dict, tokens: dict) -> ModelConfig:
    """From a glm4moe file's metadata (`meta(key, default)`, keys as llama.cpp's conversion/glm.py writes them) and
    tensor names: the MTP layers counted in block_count, rope over `rope.dimension_count` dims of each head (the
    partial rotary), biases and q/k norms where the file holds them."""
    nextn = int(meta("nextn_predict_layers", 0))
    layers = int(meta("block_count")) - nextn
    heads, hidden = int(meta("attention.head_count")), int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    expert_size = int(meta("expert_feed_forward_length"))
    moe = MoEConfig(num_experts=int(meta("expert_count")), experts_per_token=int(meta("expert_used_count")),
                    expert_size=expert_size,
                    dense_layers=dense_layers(layers, first_dense=int(meta("leading_dense_block_count", 0))),
                    scoring="sigmoid", score_bias=True, groups=int(meta("expert_group_count", 1)),
                    groups_kept=int(meta("expert_group_used_count", 1)),
                    renormalize=bool(meta("expert_weights_norm", False)),
                    scaling=stored_float(meta("expert_weights_scale", 1.0)), float32_router=True,
                    shared_size=expert_size * int(meta("expert_shared_count", 1)))
    eos = tokens.get("eos")
    return ModelConfig(
        architecture="glm4_moe", vocab_size=int(tensors["token_embd.weight"].shape[1]), hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")), num_layers=layers, num_heads=heads,
        num_kv_heads=int(meta("attention.head_count_kv", heads)), head_dim=head_dim,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors, bos_token_id=tokens.get("bos"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        mtp_layers=nextn if f"blk.{layers}.nextn.eh_proj.weight" in tensors else 0, mtp_declared=nextn,
        mtp_layout="deepseek", rotary_dim=int(meta("rope.dimension_count", head_dim)), moe=moe)


def to_hf(config: ModelConfig) -> dict:
    moe = config.moe
    return config.common_hf() | {
        "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "attention_bias": config.qkv_bias,
        "use_qk_norm": config.qk_norm, "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.experts_per_token, "moe_intermediate_size": moe.expert_size,
        "n_shared_experts": moe.shared_size // moe.expert_size, "first_k_dense_replace": len(moe.dense_layers),
        "n_group": moe.groups, "topk_group": moe.groups_kept, "norm_topk_prob": moe.renormalize,
        "routed_scaling_factor": moe.scaling, "num_nextn_predict_layers": config.mtp_layers,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta,
                            "partial_rotary_factor": config.rotary_dim / config.head_dim}}
