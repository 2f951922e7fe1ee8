"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B): the Llama-style decoder with Qwen3's attention,
each sparse layer's MLP a mixture of experts (decoder/moe.py); read from Hugging Face checkpoints (per layer the
attention with q/k norms, the two norms, and the router `mlp.gate` with experts `mlp.experts.{e}.*_proj`, stored
per expert or fused, formats/layer_names.py and weight_source.py) and llama.cpp's qwen3moe GGUF files;
batch-invariant on the shared fixed-order float layers and w4a8 matmuls (kernels/float_decoder.py), which keep the
experts."""

from __future__ import annotations

from pathlib import Path

from specdecode.models.decoder.moe import MoETransformer
from specdecode.models.families.base import GGUFMeta, ModelFamily
from specdecode.models.families.qwen3_moe import config
from specdecode.models.families.registry import register_family
from specdecode.models.formats.gguf_layout import GGUFLayout
from specdecode.models.formats.gguf_names import MOE_BLOCK_NAMES, llama_style_name
from specdecode.models.formats.layer_names import sparse_trunk_shapes, sparse_trunk_sources
from specdecode.models.kernels.float_decoder import fix_float_layers, float_batch_invariant
from specdecode.models.kernels.w4a8_decoder import fuse_moe_layers, fused_batch_invariant
from specdecode.models.model_config import ModelConfig


class Qwen3MoeFamily(ModelFamily):
    name = "qwen3_moe"
    model_types = config.MODEL_TYPES
    gguf_architectures = {config.GGUF_ARCHITECTURE: "qwen3_moe"}

    def config_from_hf(self, hf: dict, model_type: str) -> ModelConfig:
        return config.from_hf(hf, model_type)

    def config_to_hf(self, model_config: ModelConfig) -> dict:
        return config.to_hf(model_config)

    def config_from_gguf(self, meta: GGUFMeta, architecture: str, tensors_: dict, tokens: dict, path: Path,
                         companion: bool = False) -> ModelConfig:
        return config.from_gguf(meta, tensors_, tokens, path)

    def sources(self, model_config: ModelConfig) -> dict[str, list[str]]:
        return sparse_trunk_sources(model_config)

    def shapes(self, model_config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return sparse_trunk_shapes(model_config)

    def gguf_layout(self, model_config: ModelConfig, architecture: str) -> GGUFLayout:
        # Its converter keeps Hugging Face's row order (no q/k interleaving): names alone differ.
        return GGUFLayout(lambda name: llama_style_name(name, MOE_BLOCK_NAMES))

    def build(self, model_config: ModelConfig) -> MoETransformer:
        return MoETransformer(model_config)

    def fuse_w4a8(self, model: MoETransformer) -> None:
        fuse_moe_layers(model)

    def fix_float(self, model: MoETransformer) -> str | None:
        return fix_float_layers(model)

    def batch_invariant(self, model: MoETransformer) -> bool:
        return fused_batch_invariant(model) or (float_batch_invariant(model) and model.routers_invariant)


register_family(Qwen3MoeFamily())
