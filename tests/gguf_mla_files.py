"""deepseek2 GGUF files for tests, written as llama.cpp's converter writes them (conversion/deepseek.py's
DeepseekV2Model, which conversion/glm.py's GLM-4.7-Flash reuses): latent attention under its own names, kv_b_proj
split per head into attn_k_b (each head's key half transposed: torch [nh, C, nope]) and attn_v_b ([nh, v, C]),
one key/value head in the metadata, the MLA sizes under key_length_mla/value_length_mla, the routing under the
expert_* keys, YaRN's mscale_all_dim as yarn_log_multiplier = 0.1 * it, MTP blocks as `blk.{L}.nextn.*`. Every
tensor in F32, so the file is exactly its folder."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from conftest import TINY_VOCAB
from gguf_files import F32, add_vocabulary, finish, hf_weights
from gguf_moe_files import add

# Hugging Face name after "model.layers.N." -> llama.cpp's (gguf-py tensor_mapping.py)
_BLOCK = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_a_proj.weight": "attn_q_a.weight",
          "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight", "self_attn.q_b_proj.weight": "attn_q_b.weight",
          "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
          "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
          "self_attn.kv_b_proj.weight": "attn_kv_b.weight", "self_attn.o_proj.weight": "attn_output.weight",
          "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight", "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
          "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
          "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
          "eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
          "hnorm.weight": "nextn.hnorm.weight", "shared_head.norm.weight": "nextn.shared_head_norm.weight"}
_EXPERTS = {"gate_proj": "ffn_gate_exps.weight", "up_proj": "ffn_up_exps.weight", "down_proj": "ffn_down_exps.weight"}


def write_deepseek2_gguf(path: Path, hf_folder: Path, split_kv_b: bool = True) -> None:
    """`hf_folder`'s DeepSeek-V3 or GLM-4.7-Flash model as a deepseek2 file; `split_kv_b` False writes kv_b_proj
    whole (attn_kv_b), as files converted before llama.cpp split it do."""
    config = json.loads((hf_folder / "config.json").read_text())
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    heads, latent = config["num_attention_heads"], config["kv_lora_rank"]
    nextn = config.get("num_nextn_predict_layers", 0)
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"] + nextn)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(rope)
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(latent)
    writer.add_key_length(latent + rope)
    writer.add_value_length(latent)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(v)
    dense = (config["mlp_layer_types"].count("dense") if "mlp_layer_types" in config
             else config["first_k_dense_replace"])
    writer.add_leading_dense_block_count(dense)
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_group_count(config.get("n_group", 1))
    writer.add_expert_group_used_count(config.get("topk_group", 1))
    if config.get("norm_topk_prob", True):
        writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    scaling = config["rope_parameters"]
    if scaling.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * scaling["mscale_all_dim"])
    if nextn:
        writer.add_nextn_predict_layers(nextn)
    add_vocabulary(writer, TINY_VOCAB, "qwen2")
    weights = hf_weights(hf_folder)
    for name, gguf_name in {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                            "lm_head.weight": "output.weight"}.items():
        add(writer, gguf_name, weights[name], F32)
    for layer in range(config["num_hidden_layers"] + nextn):
        prefix = f"model.layers.{layer}."
        for name, gguf_name in _BLOCK.items():
            if prefix + name not in weights:
                continue
            if name == "self_attn.kv_b_proj.weight" and split_kv_b:
                per_head = weights[prefix + name].reshape(heads, nope + v, latent)  # [nh, nope + v, C]
                add(writer, f"blk.{layer}.attn_k_b.weight", per_head[:, :nope].transpose(0, 2, 1), F32)
                add(writer, f"blk.{layer}.attn_v_b.weight", per_head[:, nope:], F32)
            else:
                add(writer, f"blk.{layer}.{gguf_name}", weights[prefix + name], F32)
        for part, gguf_name in _EXPERTS.items():
            experts = sorted((key for key in weights if key.startswith(f"{prefix}mlp.experts.")
                              and key.endswith(f".{part}.weight")), key=lambda key: int(key.split(".")[5]))
            if experts:  # [E, rows, columns]
                add(writer, f"blk.{layer}.{gguf_name}", np.stack([weights[key] for key in experts]), F32)
    finish(writer)
