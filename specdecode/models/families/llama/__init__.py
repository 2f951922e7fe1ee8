"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3 and MiMo (a Qwen2 trunk with MTP layers). One decoder
for all of them (decoder/transformer.py over decoder/layers.py), its differences config fields: biases, q/k norms,
a sliding window, rope scaling, tied embeddings."""

from __future__ import annotations

from pathlib import Path

from specdecode.models.decoder import llama_config as config
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.families.base import GGUFMeta, ModelFamily
from specdecode.models.families.llama import tensors
from specdecode.models.families.llama.gguf import LlamaLayout
from specdecode.models.families.registry import register_family
from specdecode.models.kernels.float_decoder import fix_float_layers, float_batch_invariant
from specdecode.models.kernels.w4a8_decoder import fuse_layers, fused_batch_invariant
from specdecode.models.model_config import ModelConfig


class LlamaFamily(ModelFamily):
    name = "llama"
    model_types = config.MODEL_TYPES
    gguf_architectures = config.GGUF_ARCHITECTURES

    def config_from_hf(self, hf: dict, model_type: str) -> ModelConfig:
        return config.from_hf(hf, model_type)

    def config_to_hf(self, model_config: ModelConfig) -> dict:
        return config.to_hf(model_config)

    def config_from_gguf(self, meta: GGUFMeta, architecture: str, tensors_: dict, tokens: dict, path: Path,
                         companion: bool = False) -> ModelConfig:
        return config.from_gguf(meta, architecture, tensors_, tokens, path)

    def sources(self, model_config: ModelConfig) -> dict[str, list[str]]:
        return tensors.sources(model_config)

    def shapes(self, model_config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return tensors.shapes(model_config)

    def mtp_names(self, model_config: ModelConfig) -> set[str]:
        return tensors.mtp_names(model_config)

    def unread(self, model_config: ModelConfig, name: str) -> bool:
        return tensors.unread(model_config, name)

    def gguf_layout(self, model_config: ModelConfig, architecture: str) -> LlamaLayout:
        return LlamaLayout(model_config, architecture)

    def build(self, model_config: ModelConfig) -> Transformer:
        return Transformer(model_config)

    def fuse_w4a8(self, model: Transformer) -> None:
        fuse_layers(model)

    def fix_float(self, model: Transformer) -> str | None:
        return fix_float_layers(model)

    def batch_invariant(self, model: Transformer) -> bool:
        return fused_batch_invariant(model) or float_batch_invariant(model)


register_family(LlamaFamily())
