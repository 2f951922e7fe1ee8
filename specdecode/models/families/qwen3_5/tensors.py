"""Where a hybrid (Qwen 3.5 / 3.6 dense) model's parameters come from in a Hugging Face checkpoint, and the shape the
config implies for each stored tensor (names without "model." or "model.language_model.").

Per layer, by layer_types:
    full attention   self_attn.{q_proj (query and output gate per head), k_proj, v_proj, o_proj, q_norm, k_norm}
    Gated DeltaNet   linear_attn.{in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm,
                     out_proj}
    both             input_layernorm, post_attention_layernorm, mlp.{gate,up,down}_proj; in the MoE models the
                     router mlp.gate, experts mlp.experts.{e}.* (fused in the published main layers, read per
                     expert, formats/weight_source.py), mlp.shared_expert.* and mlp.shared_expert_gate
The MTP module is top-level: mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm, layers.0.*}.
A multimodal checkpoint's vision tower (model.visual.*) is not read.
"""

from __future__ import annotations

from specdecode.models.formats.layer_names import moe_shapes, moe_sources
from specdecode.models.model_config import ModelConfig

VISION_PREFIX = "visual."
MTP_PARTS = {"token_norm": "pre_fc_norm_embedding", "hidden_norm": "pre_fc_norm_hidden", "proj": "fc",
             "out_norm": "norm"}


def hybrid_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Each of our parameter names -> the stored names stacked into it (q/k/v, the four input projections and
    gate/up fused)."""
    sources = {"embed.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    for i, kind in enumerate(config.layer_types):
        sources.update(_layer_sources(f"layers.{i}.", f"layers.{i}.", kind, config))
    for j in range(config.mtp_layers):
        sources.update({f"mtp.{j}.{ours}.weight": [f"mtp.{theirs}.weight"] for ours, theirs in MTP_PARTS.items()})
        sources.update(_layer_sources(f"mtp.{j}.block.", f"mtp.layers.{j}.", "full_attention", config))
    return sources


def _layer_sources(dst: str, src: str, kind: str, config: ModelConfig) -> dict[str, list[str]]:
    sources = {dst + "attn_norm.weight": [src + "input_layernorm.weight"],
               dst + "mlp_norm.weight": [src + "post_attention_layernorm.weight"]}
    if config.moe is not None:
        sources.update(moe_sources(dst, src, config))
    else:
        sources[dst + "mlp.gate_up.weight"] = [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"]
        sources[dst + "mlp.down.weight"] = [src + "mlp.down_proj.weight"]
    if kind == "linear_attention":
        attn = src + "linear_attn."
        sources[dst + "mixer.in_proj.weight"] = [attn + f"in_proj_{part}.weight" for part in ("qkv", "z", "b", "a")]
        sources.update({dst + f"mixer.{ours}": [attn + theirs] for ours, theirs in (
            ("conv", "conv1d.weight"), ("dt_bias", "dt_bias"), ("A_log", "A_log"), ("norm.weight", "norm.weight"),
            ("out_proj.weight", "out_proj.weight"))})
        return sources
    attn = src + "self_attn."
    for kind_ in ("weight", "bias") if config.qkv_bias else ("weight",):
        sources[dst + f"mixer.qkv.{kind_}"] = [attn + f"{p}_proj.{kind_}" for p in "qkv"]
        sources[dst + f"mixer.o.{kind_}"] = [attn + f"o_proj.{kind_}"]
    sources[dst + "mixer.q_norm.weight"] = [attn + "q_norm.weight"]
    sources[dst + "mixer.k_norm.weight"] = [attn + "k_norm.weight"]
    return sources


def hybrid_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every stored tensor name -> the shape the config implies for it."""
    hidden, inner, head = config.hidden_size, config.intermediate_size, config.head_dim
    heads, kv = config.num_heads * head, config.num_kv_heads * head
    keys = config.linear_num_key_heads * config.linear_key_head_dim
    values = config.linear_num_value_heads * config.linear_value_head_dim
    channels, value_heads = 2 * keys + values, config.linear_num_value_heads
    shapes = {"embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (config.vocab_size, hidden),
              "norm.weight": (hidden,)}
    common = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    common |= moe_shapes(config) if config.moe is not None else {
        "mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden),
        "mlp.down_proj.weight": (hidden, inner)}
    attention = {"self_attn.q_proj.weight": (2 * heads, hidden), "self_attn.k_proj.weight": (kv, hidden),
                 "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, heads),
                 "self_attn.q_proj.bias": (2 * heads,), "self_attn.k_proj.bias": (kv,),
                 "self_attn.v_proj.bias": (kv,), "self_attn.o_proj.bias": (hidden,),
                 "self_attn.q_norm.weight": (head,), "self_attn.k_norm.weight": (head,)}
    recurrent = {"linear_attn.in_proj_qkv.weight": (channels, hidden), "linear_attn.in_proj_z.weight": (values, hidden),
                 "linear_attn.in_proj_b.weight": (value_heads, hidden),
                 "linear_attn.in_proj_a.weight": (value_heads, hidden),
                 "linear_attn.conv1d.weight": (channels, 1, config.linear_conv_kernel),
                 "linear_attn.dt_bias": (value_heads,), "linear_attn.A_log": (value_heads,),
                 "linear_attn.norm.weight": (config.linear_value_head_dim,),
                 "linear_attn.out_proj.weight": (hidden, values)}
    for i, kind in enumerate(config.layer_types):
        parts = common | (recurrent if kind == "linear_attention" else attention)
        shapes.update({f"layers.{i}.{name}": shape for name, shape in parts.items()})
    for j in range(config.mtp_layers):
        shapes.update({f"mtp.layers.{j}.{name}": shape for name, shape in (common | attention).items()})
    if config.mtp_layers:
        shapes.update({f"mtp.{part}.weight": (hidden,) for part in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                    "norm")})
        shapes["mtp.fc.weight"] = (hidden, 2 * hidden)
    return shapes


def mtp_names(config: ModelConfig) -> set[str]:
    """The stored names of the MTP module(s) the config declares (all present or none, weight_source checks)."""
    declared = config.mtp_declared
    names = {f"mtp.{theirs}.weight" for theirs in MTP_PARTS.values()} if declared else set()
    for j in range(declared):
        names |= {name for names_ in _layer_sources("", f"mtp.layers.{j}.", "full_attention", config).values()
                  for name in names_}
    return names
