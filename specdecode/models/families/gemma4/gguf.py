"""llama.cpp's `gemma4` GGUF layout (its converter, conversion/gemma.py's Gemma4Model) read as a Gemma 4 text trunk.

Metadata (`gemma4.*`): the full-attention layers' head size is attention.key_length, the sliding layers'
attention.key_length_swa; attention.sliding_window_pattern is one bool per layer (True: sliding);
attention.head_count_kv is one number, or one per layer where the two kinds differ; feed_forward_length is one
number, or one per layer with the double-wide MLP (twice the size from the first KV-shared layer on);
attention.shared_kv_layers, embedding_length_per_layer_input (PLE width), rope.freq_base (full layers) and
rope.freq_base_swa, final_logit_softcapping. Full layers' "proportional" rope is stored as rope_freqs: a factor of
1 for each rotating frequency and 1e30 for the others, so the share that rotates is the share of ones. A full layer
without attn_v uses its keys as values (attention_k_eq_v). Norm weights are stored as they are (no 1 + w, unlike
Gemma 3), layer_scalar as blk.N.layer_output_scale.weight, and nothing is permuted.

With experts (26B-A4B): expert_count, expert_used_count and expert_feed_forward_length; per layer the router as
ffn_gate_inp.weight, its scale as ffn_gate_inp.scale and its per-expert scale as ffn_down_exps.scale, the experts
as ffn_gate_up_exps (gate rows then up rows, as transformers' gate_up_proj; or ffn_gate_exps and ffn_up_exps) and
ffn_down_exps, and the norms pre_ffw_norm_2, post_ffw_norm_1 and post_ffw_norm_2.
"""

from __future__ import annotations

import re

import numpy as np

from specdecode.errors import SpecDecodeError
from specdecode.models.families.gemma4.config import from_hf
from specdecode.models.formats.weight_source import EXPERT
from specdecode.models.model_config import ModelConfig

ARCHITECTURE = "gemma4"
_GLOBAL = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
           "output.weight": "lm_head.weight", "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
           "per_layer_model_proj.weight": "per_layer_model_projection.weight",
           "per_layer_proj_norm.weight": "per_layer_projection_norm.weight"}
_BLOCK = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
          "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
          "attn_output.weight": "self_attn.o_proj.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
          "attn_k_norm.weight": "self_attn.k_norm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
          "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
          "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
          "ffn_down.weight": "mlp.down_proj.weight", "inp_gate.weight": "per_layer_input_gate.weight",
          "proj.weight": "per_layer_projection.weight", "post_norm.weight": "post_per_layer_input_norm.weight",
          "layer_output_scale.weight": "layer_scalar", "ffn_gate_inp.weight": "router.proj.weight",
          "ffn_gate_inp.scale": "router.scale", "ffn_down_exps.scale": "router.per_expert_scale",
          "ffn_gate_up_exps.weight": f"experts.{EXPERT}.gate_up_proj.weight",
          "ffn_gate_exps.weight": f"experts.{EXPERT}.gate_proj.weight",
          "ffn_up_exps.weight": f"experts.{EXPERT}.up_proj.weight",
          "ffn_down_exps.weight": f"experts.{EXPERT}.down_proj.weight",
          "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
          "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
          "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight"}
_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")
ROPE_FREQS = "rope_freqs.weight"


def gemma4_config(meta, tensors: dict, eos: int | None, bos: int | None) -> ModelConfig:
    """The config from the file's `gemma4.*` metadata (`meta(key, default)`) and tensors, read as transformers'
    gemma4_text config would state it."""
    layers = int(meta("block_count"))
    sliding = _per_layer(meta("attention.sliding_window_pattern"), layers)
    kinds = ["sliding_attention" if flag else "full_attention" for flag in sliding]
    kv_heads = _per_layer(meta("attention.head_count_kv"), layers)
    feed_forward = _per_layer(meta("feed_forward_length"), layers)
    full = kinds.index("full_attention")
    swa = kinds.index("sliding_attention") if "sliding_attention" in kinds else full
    shared = int(meta("attention.shared_kv_layers", 0))
    global_head_dim = int(meta("attention.key_length"))
    k_eq_v = f"blk.{full}.attn_v.weight" not in tensors
    hf = {"model_type": "gemma4_text", "vocab_size": int(tensors["token_embd.weight"].shape[1]),
          "hidden_size": int(meta("embedding_length")), "intermediate_size": int(min(feed_forward)),
          "num_hidden_layers": layers, "num_attention_heads": int(meta("attention.head_count")),
          "num_key_value_heads": int(kv_heads[swa]), "head_dim": int(meta("attention.key_length_swa", global_head_dim)),
          "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
          "max_position_embeddings": int(meta("context_length", 4096)), "layer_types": kinds,
          "sliding_window": int(meta("attention.sliding_window", 512)), "num_kv_shared_layers": shared,
          "hidden_size_per_layer_input": int(meta("embedding_length_per_layer_input", 0)),
          "attention_k_eq_v": k_eq_v, "use_double_wide_mlp": len(set(feed_forward)) > 1,
          "final_logit_softcapping": meta("final_logit_softcapping"),
          "tie_word_embeddings": "output.weight" not in tensors, "bos_token_id": bos, "eos_token_id": eos,
          "per_layer_config": {str(full): {"head_dim": global_head_dim, "num_key_value_heads": int(kv_heads[full])}},
          "rope_parameters": {"sliding_attention": {"rope_type": "default",
                                                    "rope_theta": float(meta("rope.freq_base_swa", 10000.0))},
                              "full_attention": {"rope_type": "proportional",
                                                 "partial_rotary_factor": _rotating_share(tensors, global_head_dim),
                                                 "rope_theta": float(meta("rope.freq_base", 1000000.0))}}}
    if "blk.0.ffn_gate_inp.weight" in tensors:
        hf.update(enable_moe_block=True, num_experts=int(meta("expert_count")),
                  top_k_experts=int(meta("expert_used_count")),
                  moe_intermediate_size=int(meta("expert_feed_forward_length")))
    if "per_layer_token_embd.weight" in tensors:
        hf["vocab_size_per_layer_input"] = int(tensors["per_layer_token_embd.weight"].shape[1])
    return from_hf(hf, "gemma4_text")


def _per_layer(value, layers: int) -> list:
    """One value per layer from a GGUF number or array."""
    values = value if isinstance(value, list) else [value] * layers
    if len(values) != layers or any(v is None for v in values):
        raise SpecDecodeError(f"a gemma4 GGUF file's per-layer metadata must name each of its {layers} layers")
    return values


def _rotating_share(tensors: dict, head_dim: int) -> float:
    """The share of the full layers' frequencies that rotate: rope_freqs' factors of 1 (the others are 1e30)."""
    if ROPE_FREQS not in tensors:
        return 1.0
    factors = np.asarray(tensors[ROPE_FREQS].data, dtype=np.float32).reshape(-1)
    return float(np.count_nonzero(factors < 1e10)) * 2 / head_dim


def gemma4_hf_name(gguf_name: str) -> str:
    """A tensor's name in the file -> Hugging Face's (rope_freqs, read into the config, as itself)."""
    if gguf_name == ROPE_FREQS:
        return "rope_freqs"
    if gguf_name in _GLOBAL:
        return "model." + _GLOBAL[gguf_name]
    match = _PATTERN.fullmatch(gguf_name)
    if match is not None and match.group(2) in _BLOCK:
        return f"model.layers.{match.group(1)}.{_BLOCK[match.group(2)]}"
    raise SpecDecodeError(f"unsupported tensor {gguf_name!r} in a {ARCHITECTURE} GGUF file")
