"""DeepSeek-V3 (V3, V3.1, R1, Kimi K2) and GLM-4.7-Flash (transformers' glm4_moe_lite): multi-head latent
attention (decoder/mla.py) over the shared mixture of experts (decoder/moe.py) with DeepSeek's routing, its cache
each token's latent and rotary key (decoder/latent_cache.py), its MTP modules in DeepSeek's layout; read from
Hugging Face checkpoints and llama.cpp's deepseek2 GGUF files (gguf.py); batch-invariant with its attention in the
fixed-order kernel (kernels.py)."""

from __future__ import annotations

from pathlib import Path

from specdecode.models.families.base import GGUFMeta, ModelFamily
from specdecode.models.families.deepseek_v3 import config, tensors
from specdecode.models.families.deepseek_v3.gguf import LatentLayout
from specdecode.models.families.deepseek_v3.kernels import fix_latent_layers, latent_batch_invariant
from specdecode.models.families.deepseek_v3.trunk import LatentTransformer
from specdecode.models.families.registry import register_family
from specdecode.models.kernels.w4a8_latent import fuse_latent_layers
from specdecode.models.kernels.w4a8_moe import fuse_moe_blocks
from specdecode.models.model_config import ModelConfig


class DeepseekV3Family(ModelFamily):
    name = "deepseek_v3"
    model_types = config.MODEL_TYPES
    gguf_architectures = {"deepseek2": "deepseek_v3"}  # GLM-4.7-Flash's files too (llama.cpp conversion/glm.py)
    not_supported = {
        "deepseek_v32": "DeepSeek-V3.2: its sparse attention (the lightning indexer choosing 2048 tokens a query) "
                        "is not implemented; DeepSeek-V3 and V3.1 are",
        "deepseek_v2": "DeepSeek-V2: its softmax routing with group-limited greedy choice is not implemented; "
                       "DeepSeek-V3's latent attention and routing are",
    }
    cache_kind = "latent"

    def config_from_hf(self, hf: dict, model_type: str) -> ModelConfig:
        return config.from_hf(hf, model_type)

    def config_to_hf(self, model_config: ModelConfig) -> dict:
        return config.to_hf(model_config)

    def config_from_gguf(self, meta: GGUFMeta, architecture: str, tensors_: dict, tokens: dict, path: Path,
                         companion: bool = False) -> ModelConfig:
        return config.from_gguf(meta, tensors_, tokens)

    def gguf_layout(self, model_config: ModelConfig, architecture: str) -> LatentLayout:
        return LatentLayout()

    def tokenizer_from_gguf_alone(self) -> bool:
        return True  # transformers reads no deepseek2 model config from a GGUF file

    def sources(self, model_config: ModelConfig) -> dict[str, list[str]]:
        return tensors.sources(model_config)

    def shapes(self, model_config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return tensors.shapes(model_config)

    def mtp_names(self, model_config: ModelConfig) -> set[str]:
        return tensors.mtp_names(model_config)

    def unread(self, model_config: ModelConfig, name: str) -> bool:
        return tensors.unread(model_config, name)

    def build(self, model_config: ModelConfig) -> LatentTransformer:
        return LatentTransformer(model_config)

    def fuse_w4a8(self, model: LatentTransformer) -> None:
        # The mixtures of experts compiled (kernels/w4a8_moe.py), every latent attention in its fixed-order form
        # with its per-head weights in int8 (the MTP modules' stay so), then the trunk's layers fused whole where
        # they can be (kernels/w4a8_latent.py).
        fuse_moe_blocks(model)
        if fix_latent_layers(model, int8_heads=True) is None:
            fuse_latent_layers(model)

    def fix_float(self, model: LatentTransformer) -> str | None:
        return fix_latent_layers(model)

    def batch_invariant(self, model: LatentTransformer) -> bool:
        return latent_batch_invariant(model)


register_family(DeepseekV3Family())
