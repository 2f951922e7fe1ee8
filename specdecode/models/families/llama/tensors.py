"""Where a Llama-family model's parameters come from in a Hugging Face checkpoint (names without "model."), and the
shape the config implies for each stored tensor: the trunk's Llama-style blocks and, where it ships them, MTP
modules in DeepSeek's layout (after the trunk's layers) or MiMo's (model.mtp_layers)."""

from __future__ import annotations

from dataclasses import replace

from specdecode.models.formats.layer_names import (
    block_shapes,
    block_sources,
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
        found.update(block_sources(f"layers.{i}.", f"layers.{i}.", config))
    for j in range(config.mtp_layers):
        found.update(mtp_sources(j, config))
    return found


def mtp_sources(j: int, config: ModelConfig) -> dict[str, list[str]]:
    """MTP module j's parameters -> their stored names."""
    return mtp_part_sources(j, config) | block_sources(f"mtp.{j}.block.", mtp_prefix(j, config), config)


def mtp_names(config: ModelConfig) -> set[str]:
    """The stored names of the MTP modules the config declares (all present or none, model_files checks)."""
    declared = replace(config, mtp_layers=config.mtp_declared)
    return {name for j in range(config.mtp_declared) for names in mtp_sources(j, declared).values() for name in names}


def shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name -> the shape the config implies for it."""
    hidden = config.hidden_size
    found = {"embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (config.vocab_size, hidden),
             "norm.weight": (hidden,), "rope_freqs": (config.head_dim // 2,)}
    per_layer = block_shapes(config)
    for i in range(config.num_layers):
        found.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    for j in range(config.mtp_layers):
        found.update({f"{mtp_prefix(j, config)}{name}": shape for name, shape in per_layer.items()})
        found.update(mtp_part_shapes(j, config))
    return found


def unread(config: ModelConfig, name: str) -> bool:
    """The DeepSeek-named MTP modules' copies of the trunk's embedding and head are never read."""
    return name in mtp_shared_copies(config)
