"""Qwen 3.5 / 3.6, dense and MoE (qwen3_5_moe: a mixture of experts for every layer's MLP, decoder/moe.py): a
hybrid trunk of Gated DeltaNet layers (recurrent, gated_deltanet.py) and gated full-attention layers (layers.py),
behind the Llama family's Transformer interface (trunk.py), its cache KV rows
plus per-row recurrent states (cache.py), with one MTP module; read from Hugging Face checkpoints (text-only and
multimodal) and llama.cpp's qwen35 and qwen35moe GGUF files (gguf.py)."""

from __future__ import annotations

from pathlib import Path

from specdecode.models.families.base import GGUFMeta, ModelFamily
from specdecode.models.families.qwen3_5 import config, tensors
from specdecode.models.families.qwen3_5.gguf import ARCHITECTURE, MOE_ARCHITECTURE, Qwen35Layout, qwen35_config
from specdecode.models.families.qwen3_5.kernels import fix_hybrid_layers, hybrid_batch_invariant
from specdecode.models.families.qwen3_5.trunk import HybridTransformer
from specdecode.models.families.registry import register_family
from specdecode.models.heap import keep_freed_heap
from specdecode.models.kernels.w4a8_moe import fuse_moe_blocks
from specdecode.models.model_config import ModelConfig


class Qwen35Family(ModelFamily):
    name = "qwen3_5"
    model_types = config.MODEL_TYPES
    gguf_architectures = {ARCHITECTURE: "qwen3_5", MOE_ARCHITECTURE: "qwen3_5_moe"}
    not_supported = {"qwen3_next": "Qwen3-Next: a mixture-of-experts hybrid; its experts are not implemented"}
    cache_kind = "kv+recurrent"

    def config_from_hf(self, hf: dict, model_type: str) -> ModelConfig:
        return config.from_hf(hf, model_type)

    def config_to_hf(self, model_config: ModelConfig) -> dict:
        return config.to_hf(model_config)

    def config_from_gguf(self, meta: GGUFMeta, architecture: str, tensors_: dict, tokens: dict, path: Path,
                         companion: bool = False) -> ModelConfig:
        return qwen35_config(meta, tensors_, path, companion, architecture)

    def sources(self, model_config: ModelConfig) -> dict[str, list[str]]:
        return tensors.hybrid_sources(model_config)

    def shapes(self, model_config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return tensors.hybrid_shapes(model_config)

    def mtp_names(self, model_config: ModelConfig) -> set[str]:
        return tensors.mtp_names(model_config)

    def unread(self, model_config: ModelConfig, name: str) -> bool:
        return name.startswith(tensors.VISION_PREFIX)  # a multimodal checkpoint's vision tower

    def gguf_layout(self, model_config: ModelConfig, architecture: str) -> Qwen35Layout:
        return Qwen35Layout(model_config)

    def build(self, model_config: ModelConfig) -> HybridTransformer:
        keep_freed_heap()  # its per-row states are freed and allocated again every step (heap.py)
        return HybridTransformer(model_config)

    def fuse_w4a8(self, model: HybridTransformer) -> None:
        fuse_moe_blocks(model)  # Qwen 3.5 MoE's mixtures of experts, compiled (kernels/w4a8_moe.py)
        fix_hybrid_layers(model)  # its own layers; the attention kernel where the matmuls allow

    def fix_float(self, model: HybridTransformer) -> str | None:
        return fix_hybrid_layers(model)

    def batch_invariant(self, model: HybridTransformer) -> bool:
        return hybrid_batch_invariant(model)


register_family(Qwen35Family())
