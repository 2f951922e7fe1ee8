"""What a Gemma 4 text trunk has beyond the Llama family's fields (ModelConfig.family_parts, and ModelConfig.moe
with experts), read from config.json.

Gemma 4 (transformers' models/gemma4, the e2b / e4b / 31B text models and the 26B-A4B mixture of experts):
- sliding-window and full ("global") attention layers by `layer_types`, each kind with its own rope; the full
  layers may have a wider head (`global_head_dim`) and, with `attention_k_eq_v`, their own number of KV heads and
  no value projection (the keys' projection, before its norm, is the value);
- q, k and v normed per head (v without a weight), attention scaled by 1 (the norms set the scale);
- the last `num_kv_shared_layers` layers compute no keys or values: each reads those of the last earlier layer of
  its kind, and with `use_double_wide_mlp` has an MLP twice as wide;
- per-layer embeddings (PLE): a second embedding table gives every layer a small vector per token, mixed with a
  projection of the token's embedding and added through a gated projection after the layer's MLP;
- sandwich norms (after attention and after the MLP as well as before), a scalar per layer, the embedding scaled
  by sqrt(hidden_size), GELU (tanh) in the MLP, and the output's logits soft-capped;
- with `enable_moe_block` (26B-A4B), in every layer a mixture of GeGLU experts beside the dense MLP (moe.py).

The vision and audio towers are not run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.moe import MoEConfig
from specdecode.models.model_config import ModelConfig, eos_ids

MODEL_TYPES = {"gemma4": "gemma4", "gemma4_text": "gemma4"}
GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GemmaParts:
    sliding_window: int
    global_head_dim: int  # the full-attention layers' head size
    global_kv_heads: int  # the full-attention layers' KV heads
    attention_k_eq_v: bool  # full-attention layers use their keys' projection as values
    kv_shared_layers: int  # the last this many layers read an earlier layer's keys and values
    per_layer_size: int  # PLE width per layer (0: no per-layer embeddings)
    per_layer_vocab: int  # rows of the PLE table
    double_wide_mlp: bool  # the KV-shared layers' MLP is twice intermediate_size
    final_softcap: float | None  # logits -> cap * tanh(logits / cap)
    sliding_theta: float
    global_theta: float
    global_rotary_fraction: float  # "proportional" rope: the share of each head's frequencies that rotate

    def check(self, config) -> None:
        """Against the rest of a ModelConfig `config`."""
        num_layers, layer_types = config.num_layers, config.layer_types
        if not 0 <= self.kv_shared_layers <= num_layers:
            raise SpecDecodeError(f"config: num_kv_shared_layers must be from 0 to {num_layers}, got "
                                  f"{self.kv_shared_layers}")
        # Every layer shared: an assistant's, reading the target's keys and values.
        producing = set(layer_types[: num_layers - self.kv_shared_layers])
        if self.kv_shared_layers < num_layers and producing != set(layer_types):
            raise SpecDecodeError("config: every layer kind the KV-shared layers read must have a layer before them "
                                  "that computes its keys and values")
        for name in ("sliding_window", "global_head_dim", "global_kv_heads"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise SpecDecodeError(f"config: {name} must be a positive integer, got {value!r}")
        if self.global_head_dim % 2 or not 0 <= self.global_rotary_fraction <= 1:
            raise SpecDecodeError("config: the full-attention head size must be even and its partial_rotary_factor "
                                  "between 0 and 1")

    def first_shared(self, num_layers: int) -> int:
        """The index of the first layer that computes no keys or values of its own."""
        return num_layers - self.kv_shared_layers


def layer_shape(config, kind: str) -> tuple[int, int]:
    """(KV heads, head size) of a Gemma 4 layer of `kind`, for a ModelConfig `config`."""
    if kind == "full_attention":
        return config.family_parts.global_kv_heads, config.family_parts.global_head_dim
    return config.num_kv_heads, config.head_dim


def slot_shape(config) -> tuple[int, int]:
    """(KV heads, head size) of a Gemma 4 trunk's KV cache slot: room for either layer kind's keys (the heads a
    multiple of each kind's, decoder/gemma_layers.GemmaAttention.to_slot)."""
    shapes = [layer_shape(config, kind) for kind in set(config.layer_types)]
    return math.lcm(*(heads for heads, _ in shapes)), max(dim for _, dim in shapes)


def gemma_parts(hf: dict, layer_types: list[str]) -> GemmaParts:
    """From a gemma4_text config (transformers writes the full layers' sizes as per_layer_config; Google's
    configs name them global_head_dim and num_global_key_value_heads)."""
    rope = hf.get("rope_parameters") or {}
    sliding_rope = rope.get("sliding_attention") or {"rope_theta": 10000.0}
    global_rope = rope.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1000000.0}
    if global_rope.get("rope_type", "default") not in ("default", "proportional") or sliding_rope.get(
            "rope_type", "default") != "default":
        raise SpecDecodeError(f"config: unsupported Gemma 4 rope {rope!r} (default sliding, proportional or "
                              "default full attention are)")
    kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    if "per_layer_config" in hf:  # transformers writes only what differs from the top level
        full_layer = next(i for i, kind in enumerate(layer_types) if kind == "full_attention")
        per_layer = (hf["per_layer_config"] or {}).get(str(full_layer)) or {}
        global_head_dim = per_layer.get("head_dim", hf.get("head_dim", 256))
        global_kv = per_layer.get("num_key_value_heads", kv_heads)
    else:  # as transformers builds per_layer_config from them (its default head size 512)
        global_head_dim = hf.get("global_head_dim", 512)
        global_kv = (hf.get("num_global_key_value_heads") if k_eq_v else None) or kv_heads
    fraction = global_rope.get("partial_rotary_factor", 1.0) if global_rope.get("rope_type") == "proportional" else 1.0
    per_layer_size = hf.get("hidden_size_per_layer_input") or 0
    return GemmaParts(
        sliding_window=hf.get("sliding_window", 512),
        global_head_dim=global_head_dim, global_kv_heads=global_kv, attention_k_eq_v=k_eq_v,
        kv_shared_layers=hf.get("num_kv_shared_layers") or 0, per_layer_size=per_layer_size,
        per_layer_vocab=hf.get("vocab_size_per_layer_input", hf["vocab_size"]) if per_layer_size else 0,
        double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)),
        final_softcap=hf.get("final_logit_softcapping"), sliding_theta=float(sliding_rope["rope_theta"]),
        global_theta=float(global_rope["rope_theta"]), global_rotary_fraction=float(fraction))


def gemma_moe(hf: dict) -> MoEConfig | None:
    """The experts of a config with enable_moe_block: softmax routing (logits in the model's dtype, weights in
    float32), the best top_k_experts always renormalised, GeGLU experts; None without it."""
    if not hf.get("enable_moe_block"):
        return None
    return MoEConfig(num_experts=hf["num_experts"], experts_per_token=hf["top_k_experts"],
                     expert_size=hf["moe_intermediate_size"], renormalize=True, activation="gelu_tanh")


def check_text_only(hf: dict) -> None:
    """Gemma 4 parts we do not run, said in one line."""
    if hf.get("use_bidirectional_attention") == "all":
        raise SpecDecodeError("a Gemma 4 config with bidirectional attention is an encoder, not a decoder")


def gemma_to_hf(parts: GemmaParts, layer_types: tuple[str, ...], head_dim: int, kv_heads: int) -> dict:
    """The gemma4_text fields of parts, as transformers reads them."""
    full_rope = {"rope_type": "proportional", "partial_rotary_factor": parts.global_rotary_fraction,
                 "rope_theta": parts.global_theta}
    per_layer = {"head_dim": parts.global_head_dim}
    if parts.attention_k_eq_v:
        per_layer["num_key_value_heads"] = parts.global_kv_heads
    return {"model_type": "gemma4_text", "layer_types": list(layer_types), "sliding_window": parts.sliding_window,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": parts.sliding_theta},
                                "full_attention": full_rope},
            "per_layer_config": {str(i): per_layer for i, kind in enumerate(layer_types) if kind == "full_attention"},
            "attention_k_eq_v": parts.attention_k_eq_v, "num_kv_shared_layers": parts.kv_shared_layers,
            "hidden_size_per_layer_input": parts.per_layer_size, "vocab_size_per_layer_input": parts.per_layer_vocab,
            "use_double_wide_mlp": parts.double_wide_mlp, "final_logit_softcapping": parts.final_softcap,
            "hidden_activation": "gelu_pytorch_tanh", "head_dim": head_dim, "num_key_value_heads": kv_heads}


def from_hf(hf: dict, model_type: str) -> ModelConfig:
    """Gemma 4's text trunk; the sizes of its sliding layers are the top-level ones."""
    check_text_only(hf)
    num_heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    layer_types = list(hf.get("layer_types") or [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)])
    layer_types[-1] = "full_attention"  # as transformers forces it
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise SpecDecodeError(f"config: unsupported Gemma 4 activation {hf['hidden_activation']!r}")
    return ModelConfig(
        architecture="gemma4", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=layers, num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=hf.get("head_dim", 256),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=bool(hf.get("attention_bias", False)), o_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True, bos_token_id=hf.get("bos_token_id"), eos_token_ids=eos_ids(hf),
        layer_types=tuple(layer_types), family_parts=gemma_parts(hf, layer_types), moe=gemma_moe(hf))


def to_hf(config: ModelConfig) -> dict:
    """Its ropes are per layer kind, in rope_parameters."""
    hf = config.common_hf() | {"architectures": ["Gemma4ForCausalLM"], "attention_bias": config.qkv_bias}
    del hf["rope_theta"], hf["rope_scaling"]
    moe = config.moe
    experts = {"enable_moe_block": moe is not None} | ({} if moe is None else {
        "num_experts": moe.num_experts, "top_k_experts": moe.experts_per_token,
        "moe_intermediate_size": moe.expert_size})
    return hf | gemma_to_hf(config.family_parts, config.layer_types, config.head_dim, config.num_kv_heads) | experts
