"""Gemma 4 GGUF files for tests and benchmarks, written the way llama.cpp's converter writes them (its
conversion/gemma.py: Gemma4Model and Gemma4AssistantModel), with gguf-py's own writer; with experts (26B-A4B)
under gguf-py's gemma4 names (constants.py, tensor_mapping.py)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf_files import F32, add_float, add_vocabulary, finish, hf_weights
from gguf_moe_files import add

# Gemma 4's tensors (after "model.layers.N." or "model.language_model.layers.N.") -> llama.cpp's gemma4 names.
_GEMMA4_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight", "post_per_layer_input_norm.weight": "post_norm.weight",
    "layer_scalar": "layer_output_scale.weight",
    "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight", "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
}
_GEMMA4_GLOBAL = {
    "embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
    "embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
    "per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "per_layer_projection_norm.weight": "per_layer_proj_norm.weight", "lm_head.weight": "output.weight",
}


def write_gemma4_gguf(path: Path, hf_folder: Path, matrices=F32, experts=F32, fused: bool = True) -> None:
    """`hf_folder`'s Gemma 4 text model as llama.cpp's converter writes it (architecture "gemma4", gemma4_header);
    float32, or its matrices in `matrices` (F16 for llama-quantize). Experts (transformers' fused [E, 2I, H] and
    [E, H, I], ggml {H, 2I, E} and {I, H, E}) in `experts` (F32, F16 or Q8_0), gate and up in one tensor as the
    converter writes them, or (`fused` False) as ffn_gate_exps and ffn_up_exps."""
    config = json.loads((hf_folder / "config.json").read_text())
    config = config.get("text_config", config)
    writer = gguf.GGUFWriter(str(path), "gemma4")
    gemma4_header(writer, config)
    for name, weight in hf_weights(hf_folder).items():
        gguf_name = gemma4_gguf_name(name)
        if gguf_name is None:  # a multimodal checkpoint's towers
            continue
        if weight.ndim == 3 and gguf_name.endswith("gate_up_exps.weight") and not fused:
            gate, up = np.split(weight, 2, axis=1)  # [E, I, H] each
            add(writer, gguf_name.replace("gate_up", "gate"), gate, experts)
            add(writer, gguf_name.replace("gate_up", "up"), up, experts)
        elif weight.ndim == 3:
            add(writer, gguf_name, weight, experts)
        else:
            add_float(writer, gguf_name, weight, matrices)
    finish(writer)


def gemma4_gguf_name(name: str) -> str | None:
    """A Gemma 4 Hugging Face tensor name -> llama.cpp's, None for what its text model does not hold."""
    name = name.removeprefix("model.").removeprefix("language_model.")
    if name in _GEMMA4_GLOBAL:
        return _GEMMA4_GLOBAL[name]
    if name.startswith("layers."):
        _, block, rest = name.split(".", 2)
        return f"blk.{block}.{_GEMMA4_BLOCK[rest]}"
    return None


def gemma4_header(writer: gguf.GGUFWriter, config: dict) -> None:
    """A gemma4_text config's metadata, the tokenizer and the rope_freqs tensor as llama.cpp's converter writes
    them: per-layer arrays where the layer kinds differ (KV heads, the double-wide MLP's sizes, the sliding
    pattern), both head sizes, the full layers' proportional rope as rope_freqs factors (1 rotating, 1e30 not).
    Norms are stored as they are and the layer scalars as layer_output_scale (the tensors' part)."""
    layers, kinds = config["num_hidden_layers"], config["layer_types"]
    full = kinds.index("full_attention")
    per_layer = (config.get("per_layer_config") or {}).get(str(full), {})
    head_dim = config["head_dim"]
    global_head_dim = per_layer.get("head_dim", config.get("global_head_dim", head_dim))
    kv_heads = config["num_key_value_heads"]
    global_kv = per_layer.get("num_key_value_heads", kv_heads)
    first_shared = layers - config["num_kv_shared_layers"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(layers)
    inner = config["intermediate_size"]
    writer.add_feed_forward_length([inner * (2 if i >= first_shared else 1) for i in range(layers)]
                                   if config["use_double_wide_mlp"] else inner)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv([kv_heads if kind == "sliding_attention" else global_kv for kind in kinds])
    writer.add_key_length(global_head_dim)
    writer.add_value_length(global_head_dim)
    writer.add_key_length_swa(head_dim)
    writer.add_value_length_swa(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(global_head_dim)
    writer.add_rope_dimension_count_swa(head_dim)
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in kinds])
    writer.add_shared_kv_layers(config["num_kv_shared_layers"])
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    if config.get("enable_moe_block"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["top_k_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    add_vocabulary(writer, config["vocab_size"], "llama-bpe")
    rotating = int(rope["full_attention"].get("partial_rotary_factor", 1.0) * global_head_dim / 2)
    factors = np.array([1.0] * rotating + [1e30] * (global_head_dim // 2 - rotating), dtype=np.float32)
    writer.add_tensor("rope_freqs.weight", factors, raw_dtype=F32)


def write_gemma4_assistant_gguf(path: Path, folder: Path) -> None:
    """A Gemma 4 assistant folder (transformers' layout) as llama.cpp's converter writes it: architecture
    "gemma4-assistant", gemma4's metadata and layers, embedding_length_out (the target's hidden size),
    nextn_predict_layers, nextn.pre_projection and nextn.post_projection; the centroid head dropped, as it does."""
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"]
    writer = gguf.GGUFWriter(str(path), "gemma4-assistant")
    gemma4_header(writer, text)
    writer.add_embedding_length_out(config["backbone_hidden_size"])
    writer.add_nextn_predict_layers(text["num_hidden_layers"])
    for name, weight in hf_weights(folder).items():
        if name in ("pre_projection.weight", "post_projection.weight"):
            gguf_name = f"nextn.{name}"
        elif name.startswith("masked_embedding."):
            continue
        else:
            gguf_name = gemma4_gguf_name(name)
        add_float(writer, gguf_name, weight)
    finish(writer)
