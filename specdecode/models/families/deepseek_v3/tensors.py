"""Where a DeepSeek-V3 or GLM-4.7-Flash model's parameters come from in a Hugging Face checkpoint (names without
"model."), and the shape the config implies for each stored tensor. Per layer: latent attention
(`self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`),
the two norms, and the router `mlp.gate` (with `e_score_correction_bias`), experts `mlp.experts.{e}.*` (stored per
expert as published; transformers 5's fused folders read under the same names) and `mlp.shared_experts.*`, or in
the first layers a dense `mlp.{gate,up,down}_proj`. MTP modules follow the trunk's layers (`layers.{L+j}.` with
enorm, hnorm, eh_proj, shared_head.norm) around a sparse latent-attention block, as DeepSeek-V3's reference builds
them."""

from __future__ import annotations

from dataclasses import replace

from specdecode.models.formats.layer_names import (
    mla_block_shapes,
    mla_block_sources,
    mtp_part_shapes,
    mtp_part_sources,
    mtp_prefix,
    mtp_shared_copies,
)
from specdecode.models.model_config import ModelConfig


def sources(config: ModelConfig) -> dict[str, list[str]]:
    """Each of our parameter names -> the Hugging Face names stacked into it, in order."""
    found = {"embed.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
    if not config.tie_word_embeddings:
        found["lm_head.weight"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        found.update(mla_block_sources(f"layers.{i}.", f"layers.{i}.", config, config.moe.sparse(i)))
    for j in range(config.mtp_layers):
        found.update(mtp_sources(j, config))
    return found


def mtp_sources(j: int, config: ModelConfig) -> dict[str, list[str]]:
    """MTP module j's parameters -> their stored names (its block always sparse)."""
    return mtp_part_sources(j, config) | mla_block_sources(f"mtp.{j}.block.", mtp_prefix(j, config), config, True)


def mtp_names(config: ModelConfig) -> set[str]:
    declared = replace(config, mtp_layers=config.mtp_declared)
    return {name for j in range(config.mtp_declared) for names in mtp_sources(j, declared).values() for name in names}


def shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name -> the shape the config implies for it."""
    hidden = config.hidden_size
    found = {"embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (config.vocab_size, hidden),
             "norm.weight": (hidden,)}
    dense, sparse = mla_block_shapes(config, False), mla_block_shapes(config, True)
    for i in range(config.num_layers):
        per_layer = sparse if config.moe.sparse(i) else dense
        found.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    for j in range(config.mtp_layers):
        found.update({f"{mtp_prefix(j, config)}{name}": shape for name, shape in sparse.items()})
        found.update(mtp_part_shapes(j, config))
    return found


def unread(config: ModelConfig, name: str) -> bool:
    """The MTP modules' copies of the trunk's embedding and head are never read."""
    return name in mtp_shared_copies(config)
