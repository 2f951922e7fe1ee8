"""Where a Qwen3-MoE model's parameters come from in a Hugging Face checkpoint (names without "model."), and the
shape the config implies for each stored tensor. Per layer: the Llama-style attention with q/k norms, the two norms,
and either the router `mlp.gate` with experts `mlp.experts.{e}.{gate,up,down}_proj` (published checkpoints store
them per expert; transformers 5's fused `mlp.experts.gate_up_proj` is read under the same names,
formats/weight_source.py) or, in the layers the config keeps dense, `mlp.{gate,up,down}_proj`."""

from __future__ import annotations

from specdecode.models.formats.layer_names import block_shapes, block_sources, sparse_block_shapes
from specdecode.models.model_config import ModelConfig


def sources(config: ModelConfig) -> dict[str, list[str]]:
    """Each of our parameter names -> the Hugging Face names stacked into it, in order."""
    found = {"embed.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
    if not config.tie_word_embeddings:
        found["lm_head.weight"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        found.update(block_sources(f"layers.{i}.", f"layers.{i}.", config, config.moe.sparse(i)))
    return found


def shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name -> the shape the config implies for it."""
    hidden = config.hidden_size
    found = {"embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (config.vocab_size, hidden),
             "norm.weight": (hidden,)}
    dense, sparse = block_shapes(config), sparse_block_shapes(config)
    for i in range(config.num_layers):
        per_layer = sparse if config.moe.sparse(i) else dense
        found.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    return found
