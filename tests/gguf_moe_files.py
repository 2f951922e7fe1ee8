"""Mixture-of-experts GGUF files for tests, written as llama.cpp's converter writes them (conversion/qwen.py's
Qwen2MoeModel for qwen3moe, conversion/glm.py's Glm4MoeModel for glm4moe): the per-expert tensors of a Hugging Face
folder stacked into one 3-D tensor per layer and projection (`ffn_{gate,up,down}_exps`, torch [E, rows, columns],
ggml {columns, rows, E}), the router as `ffn_gate_inp`, everything else under the Llama-style names."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from conftest import TINY_VOCAB
from gguf_files import F16, F32, Q8_0, add_vocabulary, finish, hf_weights

_ATTENTION = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
              "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
              "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
              "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
# glm4moe's own: the MLP's norm as post_attention_norm, q/k/v biases, the selection bias, the shared expert, and
# the MTP layer's parts (blk.{L}.nextn.*)
_GLM = _ATTENTION | {"post_attention_layernorm.weight": "post_attention_norm.weight",
                     "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                     "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
                     "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
                     "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
                     "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
                     "eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
                     "hnorm.weight": "nextn.hnorm.weight",
                     "shared_head.norm.weight": "nextn.shared_head_norm.weight"}
_EXPERTS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}


def write_qwen3moe_gguf(path: Path, hf_folder: Path, experts_type=Q8_0) -> dict[str, np.ndarray]:
    """`hf_folder`'s Qwen3-MoE model as a qwen3moe GGUF file: matrices in F16 (a folder of float16-exact weights
    reads back exactly), norms and the router in F32 (llama-quantize never quantizes ffn_gate_inp), the experts
    in `experts_type`. -> GGUF name -> the array stored, for the stacked experts."""
    config = json.loads((hf_folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    add_vocabulary(writer, TINY_VOCAB, "qwen2")
    return add_moe_tensors(writer, hf_weights(hf_folder), config["num_hidden_layers"], _ATTENTION, experts_type)


def write_glm4moe_gguf(path: Path, hf_folder: Path) -> None:
    """`hf_folder`'s GLM-4.5 model as a glm4moe GGUF file (matrices in F16, experts in F16): the MTP layers counted
    in block_count and written as blk.{L}.*, the partial rotary as rope.dimension_count, the routing under the
    expert_* keys."""
    config = json.loads((hf_folder / "config.json").read_text())
    nextn = config.get("num_nextn_predict_layers", 0)
    writer = gguf.GGUFWriter(str(path), "glm4moe")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"] + nextn)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    partial = config["rope_parameters"].get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    writer.add_rope_dimension_count(int(config["head_dim"] * partial))
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    add_vocabulary(writer, TINY_VOCAB, "qwen2")
    add_moe_tensors(writer, hf_weights(hf_folder), config["num_hidden_layers"] + nextn, _GLM, F16)


def add_moe_tensors(writer: gguf.GGUFWriter, weights: dict[str, np.ndarray], layers: int, names: dict[str, str],
                    experts_type) -> dict[str, np.ndarray]:
    """Every tensor of `weights` (a folder's) under llama.cpp's names (`names`: a block's, after
    "model.layers.N."), the experts stacked; matrices in F16, vectors and the router in F32; then the file is
    written. -> GGUF name -> the array stored, for the stacked experts."""
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    for name, gguf_name in globals_.items():
        add(writer, gguf_name, weights[name], F16)
    stacked = {}
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        for name, gguf_name in names.items():
            if prefix + name in weights:
                add(writer, f"blk.{layer}.{gguf_name}", weights[prefix + name], F32 if "gate." in name else F16)
        for part, gguf_name in _EXPERTS.items():
            experts = sorted((key for key in weights if key.startswith(f"{prefix}mlp.experts.")
                              and key.endswith(f".{part}.weight")), key=lambda key: int(key.split(".")[5]))
            if experts:  # [E, rows, columns], expert e at index e
                stacked[f"blk.{layer}.{gguf_name}"] = np.stack([weights[key] for key in experts])
                add(writer, f"blk.{layer}.{gguf_name}", stacked[f"blk.{layer}.{gguf_name}"], experts_type)
    finish(writer)
    return stacked


def add(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype) -> None:
    data = np.ascontiguousarray(data, dtype=np.float32)
    if data.ndim == 1 or qtype == F32:
        writer.add_tensor(name, data, raw_dtype=F32)
    elif qtype == F16:
        writer.add_tensor(name, data.astype(np.float16), raw_dtype=F16)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
