"""The trunk a config describes: the Llama family's, the hybrid (Qwen 3.5) or Gemma 4's."""

from __future__ import annotations

from specdecode.models.decoder.gemma import GemmaTransformer
from specdecode.models.decoder.hybrid import HybridTransformer
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.heap import keep_freed_heap
from specdecode.models.model_config import ModelConfig


def build_model(config: ModelConfig) -> Transformer:
    """Its weights not loaded (call under torch.device("meta") to allocate none)."""
    if config.is_gemma:
        return GemmaTransformer(config)
    if not config.is_hybrid:
        return Transformer(config)
    keep_freed_heap()  # its per-row states are freed and allocated again every step (heap.py)
    return HybridTransformer(config)
