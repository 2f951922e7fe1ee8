"""Where a Gemma 4 text trunk's parameters come from in a Hugging Face checkpoint (names without "model." or
"model.language_model."), and the shape the config implies for each stored tensor.

Per layer: input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm,
self_attn.{q_proj, k_proj, v_proj, o_proj, q_norm, k_norm} (k_proj, v_proj and k_norm only below the KV-shared
layers; no v_proj in full layers with attention_k_eq_v), mlp.{gate,up,down}_proj, layer_scalar, and with PLE
per_layer_input_gate, per_layer_projection, post_per_layer_input_norm; with experts (enable_moe_block)
router.{proj.weight, scale, per_expert_scale}, experts.{e}.{gate,up,down}_proj (transformers 5 stores them fused
as experts.gate_up_proj and experts.down_proj, read per expert by formats/weight_source.py),
pre_feedforward_layernorm_2, post_feedforward_layernorm_1 and post_feedforward_layernorm_2. Top level: embed_tokens, norm, and with
PLE embed_tokens_per_layer, per_layer_model_projection, per_layer_projection_norm. A multimodal checkpoint's
vision and audio towers and their embedders are not read; KV-shared layers' key and value weights, which some
checkpoints carry although nothing reads them, are not either.
"""

from __future__ import annotations

from specdecode.models.families.gemma4.config import layer_shape
from specdecode.models.model_config import ModelConfig

NOT_TEXT_PREFIXES = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")
_SHARED_UNREAD = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight")


def gemma_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Each of our parameter names -> the stored names stacked into it (q/k/v and gate/up fused)."""
    parts = config.family_parts
    sources = {"embed.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    if parts.per_layer_size:
        sources.update({"per_layer_embed.weight": ["embed_tokens_per_layer.weight"],
                        "per_layer_projection.weight": ["per_layer_model_projection.weight"],
                        "per_layer_norm.weight": ["per_layer_projection_norm.weight"]})
    for i in range(config.num_layers):
        sources.update(layer_sources(f"layers.{i}.", f"layers.{i}.", config, i, bool(parts.per_layer_size)))
    return sources


def layer_sources(dst: str, src: str, config: ModelConfig, index: int, ple: bool) -> dict[str, list[str]]:
    """One decoder layer's parameters under `dst` -> the stored names under `src` (a Gemma 4 assistant's layers
    share every key and value, and have no PLE)."""
    attn = src + "self_attn."
    sources = {dst + ours: [src + theirs] for ours, theirs in (
        ("attn_norm.weight", "input_layernorm.weight"), ("post_attn_norm.weight", "post_attention_layernorm.weight"),
        ("mlp_norm.weight", "pre_feedforward_layernorm.weight"),
        ("post_mlp_norm.weight", "post_feedforward_layernorm.weight"), ("layer_scalar", "layer_scalar"),
        ("attn.o.weight", "self_attn.o_proj.weight"), ("attn.q_norm.weight", "self_attn.q_norm.weight"),
        ("mlp.down.weight", "mlp.down_proj.weight"))}
    sources[dst + "mlp.gate_up.weight"] = [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"]
    if _shares_kv(config, index):
        sources[dst + "attn.q.weight"] = [attn + "q_proj.weight"]
    else:
        values_from_keys = config.family_parts.attention_k_eq_v and config.layer_types[index] == "full_attention"
        sources[dst + "attn.qkv.weight"] = [attn + f"{p}_proj.weight" for p in ("qk" if values_from_keys else "qkv")]
        sources[dst + "attn.k_norm.weight"] = [attn + "k_norm.weight"]
    if ple:
        sources.update({dst + ours: [src + theirs] for ours, theirs in (
            ("ple_gate.weight", "per_layer_input_gate.weight"), ("ple_projection.weight", "per_layer_projection.weight"),
            ("ple_norm.weight", "post_per_layer_input_norm.weight"))})
    if config.moe is not None:
        sources.update(expert_sources(dst, src, config.moe.num_experts))
    return sources


def expert_sources(dst: str, src: str, experts: int) -> dict[str, list[str]]:
    """A layer's experts (families/gemma4/moe.py) under `dst` -> the stored names under `src`."""
    sources = {dst + ours: [src + theirs] for ours, theirs in (
        ("moe.router.weight", "router.proj.weight"), ("moe.router.scale", "router.scale"),
        ("moe.router.per_expert_scale", "router.per_expert_scale"),
        ("moe.norm_in.weight", "pre_feedforward_layernorm_2.weight"),
        ("moe.norm_out.weight", "post_feedforward_layernorm_2.weight"),
        ("post_dense_norm.weight", "post_feedforward_layernorm_1.weight"))}
    for e in range(experts):
        stored = f"{src}experts.{e}."
        sources[f"{dst}moe.experts.{e}.gate_up.weight"] = [stored + "gate_proj.weight", stored + "up_proj.weight"]
        sources[f"{dst}moe.experts.{e}.down.weight"] = [stored + "down_proj.weight"]
    return sources


def gemma_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every stored tensor name -> the shape the config implies for it."""
    parts, hidden, size = config.family_parts, config.hidden_size, config.family_parts.per_layer_size
    shapes = {"embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (config.vocab_size, hidden),
              "norm.weight": (hidden,), "embed_tokens_per_layer.weight": (parts.per_layer_vocab,
                                                                          config.num_layers * size),
              "per_layer_model_projection.weight": (config.num_layers * size, hidden),
              "per_layer_projection_norm.weight": (size,), "rope_freqs": (parts.global_head_dim // 2,)}
    for i in range(config.num_layers):
        shapes.update(layer_shapes(f"layers.{i}.", config, i, size))
    return shapes


def layer_shapes(prefix: str, config: ModelConfig, index: int, ple_size: int) -> dict[str, tuple[int, ...]]:
    hidden = config.hidden_size
    kv_heads, dim = layer_shape(config, config.layer_types[index])
    wide = 2 if config.family_parts.double_wide_mlp and _shares_kv(config, index) else 1
    inner = config.intermediate_size * wide
    q_size, kv_size = config.num_heads * dim, kv_heads * dim
    shapes = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
              "pre_feedforward_layernorm.weight": (hidden,), "post_feedforward_layernorm.weight": (hidden,),
              "layer_scalar": (1,), "self_attn.q_proj.weight": (q_size, hidden),
              "self_attn.k_proj.weight": (kv_size, hidden), "self_attn.v_proj.weight": (kv_size, hidden),
              "self_attn.o_proj.weight": (hidden, q_size), "self_attn.q_norm.weight": (dim,),
              "self_attn.k_norm.weight": (dim,), "mlp.gate_proj.weight": (inner, hidden),
              "mlp.up_proj.weight": (inner, hidden), "mlp.down_proj.weight": (hidden, inner),
              "per_layer_input_gate.weight": (ple_size, hidden), "per_layer_projection.weight": (hidden, ple_size),
              "post_per_layer_input_norm.weight": (hidden,)}
    moe = config.moe
    if moe is not None:
        shapes.update({"router.proj.weight": (moe.num_experts, hidden), "router.scale": (hidden,),
                       "router.per_expert_scale": (moe.num_experts,), "pre_feedforward_layernorm_2.weight": (hidden,),
                       "post_feedforward_layernorm_1.weight": (hidden,),
                       "post_feedforward_layernorm_2.weight": (hidden,)})
        for e in range(moe.num_experts):
            shapes.update({f"experts.{e}.gate_proj.weight": (moe.expert_size, hidden),
                           f"experts.{e}.up_proj.weight": (moe.expert_size, hidden),
                           f"experts.{e}.down_proj.weight": (hidden, moe.expert_size)})
    return {prefix + name: shape for name, shape in shapes.items()}


def unread_names(config: ModelConfig) -> set[str]:
    """Stored names a Gemma 4 checkpoint may carry that nothing reads (KV-shared layers' key and value weights)."""
    first_shared = config.family_parts.first_shared(config.num_layers)
    return {f"layers.{i}.{name}" for i in range(first_shared, config.num_layers) for name in _SHARED_UNREAD}


def _shares_kv(config: ModelConfig, index: int) -> bool:
    return index >= config.family_parts.first_shared(config.num_layers)
