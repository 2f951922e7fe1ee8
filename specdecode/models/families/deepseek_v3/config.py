"""The config of DeepSeek-V3 (V3, V3.1, R1, Kimi K2) and GLM-4.7-Flash (transformers' glm4_moe_lite): latent
attention (decoder/mla.py) over a mixture of experts routed by sigmoid scores with a selection bias, group-limited
top-k, renormalisation and routed_scaling_factor, shared experts beside them, the first layers dense, read from
config.json and written back as transformers reads it.

The two differ in their config alone: GLM-4.7-Flash names its dense layers in mlp_layer_types (transformers
ignores first_k_dense_replace there), and the defaults transformers fills in for fields a config.json leaves out.
"""

from __future__ import annotations

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.mla import MLAConfig
from specdecode.models.decoder.moe import MoEConfig
from specdecode.models.formats.gguf_read import stored_float
from specdecode.models.model_config import ModelConfig, eos_ids, rope_scaling, rope_theta

MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "glm4_moe_lite": "glm4_moe_lite"}
HF_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM"}
# transformers' defaults (configuration_deepseek_v3.py, configuration_glm4_moe_lite.py) for the routing fields
DEFAULTS = {
    "deepseek_v3": {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "n_shared_experts": 1,
                    "norm_topk_prob": True, "rope_interleave": True, "first_k_dense_replace": 3},
    "glm4_moe_lite": {"n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.8, "n_shared_experts": 1,
                      "norm_topk_prob": True, "rope_interleave": True},
}


def from_hf(hf: dict, model_type: str) -> ModelConfig:
    field = DEFAULTS[model_type] | hf
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    if model_type == "glm4_moe_lite":
        kinds = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        dense = tuple(i for i, kind in enumerate(kinds) if kind == "dense")
    else:
        dense = tuple(range(min(field["first_k_dense_replace"], layers)))
    expert_size = hf["moe_intermediate_size"]
    moe = MoEConfig(num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
                    experts_per_token=hf["num_experts_per_tok"], expert_size=expert_size, dense_layers=dense,
                    scoring="sigmoid", score_bias=True, groups=field["n_group"], groups_kept=field["topk_group"],
                    renormalize=bool(field["norm_topk_prob"]), scaling=float(field["routed_scaling_factor"]),
                    float32_router=True, shared_size=expert_size * (field["n_shared_experts"] or 0))
    mla = MLAConfig(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                    qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                    v_head_dim=hf["v_head_dim"], rope_interleave=bool(field["rope_interleave"]),
                    attention_bias=bool(hf.get("attention_bias", False)))
    # Published configs say num_nextn_predict_layers; transformers' DeepSeek-V3 calls it num_mtp_layers.
    mtp = hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0
    return ModelConfig(
        architecture=MODEL_TYPES[model_type], vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=layers, num_heads=heads,
        # Every head reads the one latent: key/value heads are the query heads once rebuilt.
        num_kv_heads=heads, head_dim=hf["qk_rope_head_dim"], rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta(hf), rope_scaling=rope_scaling(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf),
        # Present until the loader finds otherwise (model_files.with_present_mtp looks at the weights' names).
        mtp_layers=mtp, mtp_declared=mtp, moe=moe, mla=mla)


def to_hf(config: ModelConfig) -> dict:
    moe, mla = config.moe, config.mla
    hf = config.common_hf() | {
        "model_type": config.architecture, "architectures": [HF_CLASSES[config.architecture]],
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
        "moe_intermediate_size": moe.expert_size, "n_shared_experts": moe.shared_size // moe.expert_size,
        "n_group": moe.groups, "topk_group": moe.groups_kept, "norm_topk_prob": moe.renormalize,
        "routed_scaling_factor": moe.scaling, "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "rope_interleave": mla.rope_interleave, "attention_bias": mla.attention_bias,
        "num_nextn_predict_layers": config.mtp_layers}
    dense = set(moe.dense_layers)
    if config.architecture == "glm4_moe_lite":
        hf["mlp_layer_types"] = ["dense" if i in dense else "sparse" for i in range(config.num_layers)]
    else:
        hf["first_k_dense_replace"] = len(dense)  # DeepSeek's dense layers are always the first ones
    return hf


def from_gguf(meta, tensors: dict, tokens: dict) -> ModelConfig:
    """From a deepseek2 file's metadata (`meta(key, default)`, keys as llama.cpp's conversion/deepseek.py writes
    them) and tensor names, run as llama.cpp runs it: the latents' norms with the file's rms epsilon, DeepSeek-V3's
    sigmoid routing (a file that routes by softmax is DeepSeek-V2, refused), YaRN's two mscales the one
    yarn_log_multiplier / 0.1 the converter keeps."""
    if int(meta("expert_gating_func", 1)) != 2:  # gguf-py's ExpertGatingFuncType: 1 softmax, 2 sigmoid
        raise SpecDecodeError("a deepseek2 file routing by softmax is DeepSeek-V2, whose group-limited greedy "
                              "routing is not implemented; DeepSeek-V3's (sigmoid) is")
    nextn = int(meta("nextn_predict_layers", 0))
    layers = int(meta("block_count")) - nextn  # llama.cpp counts the MTP blocks in block_count
    heads, rope = int(meta("attention.head_count")), int(meta("rope.dimension_count"))
    expert_size = int(meta("expert_feed_forward_length"))
    moe = MoEConfig(num_experts=int(meta("expert_count")), experts_per_token=int(meta("expert_used_count")),
                    expert_size=expert_size, dense_layers=tuple(range(int(meta("leading_dense_block_count", 0)))),
                    scoring="sigmoid", score_bias=True, groups=int(meta("expert_group_count", 1)),
                    groups_kept=int(meta("expert_group_used_count", 1)),
                    renormalize=bool(meta("expert_weights_norm", False)),
                    scaling=stored_float(meta("expert_weights_scale", 1.0)), float32_router=True,
                    shared_size=expert_size * int(meta("expert_shared_count", 0)))
    eps = float(meta("attention.layer_norm_rms_epsilon", 1e-6))
    q_lora = meta("attention.q_lora_rank")
    mla = MLAConfig(q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(meta("attention.kv_lora_rank")),
                    qk_nope_head_dim=int(meta("attention.key_length_mla")) - rope, qk_rope_head_dim=rope,
                    v_head_dim=int(meta("attention.value_length_mla")), rope_interleave=True,
                    attention_bias="blk.0.attn_kv_a_mqa.bias" in tensors, latent_norm_eps=eps)
    scaling = None
    if meta("rope.scaling.type") == "yarn":
        mscale = stored_float(float(meta("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1)
        scaling = {"rope_type": "yarn", "factor": float(meta("rope.scaling.factor")),
                   "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
                   "mscale": mscale, "mscale_all_dim": mscale}
    eos = tokens.get("eos")
    mtp = nextn if f"blk.{layers}.nextn.eh_proj.weight" in tensors else 0
    return ModelConfig(
        architecture="deepseek_v3", vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=int(meta("embedding_length")), intermediate_size=int(meta("feed_forward_length")),
        num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=rope, rms_norm_eps=eps,
        rope_theta=float(meta("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors, bos_token_id=tokens.get("bos"),
        eos_token_ids=(int(eos),) if eos is not None else (), mtp_layers=mtp, mtp_declared=nextn, moe=moe, mla=mla)
