"""GLM-4.5 / 4.6 / Air (`glm4_moe`): the Llama-style decoder (q, k and v biases, optional q/k norms, partial rotary)
with a mixture of experts in every layer after the first dense ones (decoder/moe.py: sigmoid routing with a
correction bias, one shared expert), and the MTP layer it ships after the trunk's (`model.layers.{L}`: enorm, hnorm,
eh_proj, shared_head.norm and a sparse block), which `mtp` and `auto` draft with. Its tensors are named as
Qwen3-MoE's and DeepSeek's MTP modules are (formats/layer_names.py); read from Hugging Face checkpoints and
llama.cpp's glm4moe GGUF files (its converter keeps Hugging Face's row order: names alone differ). Batch-invariant
on the shared fixed-order float layers and w4a8 matmuls (kernels/float_decoder.py), which keep the experts."""

from __future__ import annotations

from pathlib import Path

from specdecode.models.decoder.moe import MoETransformer
from specdecode.models.families.base import GGUFMeta, ModelFamily
from specdecode.models.families.glm4_moe import config
from specdecode.models.families.registry import register_family
from specdecode.models.formats.gguf_layout import GGUFLayout
from specdecode.models.formats.gguf_names import MOE_BLOCK_NAMES, llama_style_name
from specdecode.models.formats.layer_names import (
    mtp_shared_copies,
    sparse_mtp_names,
    sparse_trunk_shapes,
    sparse_trunk_sources,
)
from specdecode.models.kernels.float_decoder import fix_float_layers, float_batch_invariant
from specdecode.models.kernels.w4a8_decoder import fuse_moe_layers, fused_batch_invariant
from specdecode.models.model_config import ModelConfig


class Glm4MoeFamily(ModelFamily):
    name = "glm4_moe"
    model_types = config.MODEL_TYPES
    gguf_architectures = {config.GGUF_ARCHITECTURE: "glm4_moe"}

    def config_from_hf(self, hf: dict, model_type: str) -> ModelConfig:
        return config.from_hf(hf, model_type)

    def config_from_gguf(self, meta: GGUFMeta, architecture: str, tensors: dict, tokens: dict, path: Path,
                         companion: bool = False) -> ModelConfig:
        return config.from_gguf(meta, tensors, tokens)

    def gguf_layout(self, model_config: ModelConfig, architecture: str) -> GGUFLayout:
        return GGUFLayout(lambda name: llama_style_name(name, MOE_BLOCK_NAMES))

    def tokenizer_from_gguf_alone(self) -> bool:
        return True  # transformers reads no glm4moe model config from a GGUF file

    def config_to_hf(self, model_config: ModelConfig) -> dict:
        return config.to_hf(model_config)

    def sources(self, model_config: ModelConfig) -> dict[str, list[str]]:
        return sparse_trunk_sources(model_config)

    def shapes(self, model_config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return sparse_trunk_shapes(model_config)

    def mtp_names(self, model_config: ModelConfig) -> set[str]:
        return sparse_mtp_names(model_config)

    def unread(self, model_config: ModelConfig, name: str) -> bool:
        return name in mtp_shared_copies(model_config)  # its MTP layer's copies of the embedding and head

    def build(self, model_config: ModelConfig) -> MoETransformer:
        return MoETransformer(model_config)

    def fuse_w4a8(self, model: MoETransformer) -> None:
        fuse_moe_layers(model)

    def fix_float(self, model: MoETransformer) -> str | None:
        return fix_float_layers(model)

    def batch_invariant(self, model: MoETransformer) -> bool:
        return fused_batch_invariant(model) or (float_batch_invariant(model) and model.routers_invariant)


register_family(Glm4MoeFamily())
