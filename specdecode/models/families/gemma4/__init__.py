"""Gemma 4 (the dense e2b / e4b / 31B text models and the 26B-A4B mixture of experts): sliding and full attention
layers with their own ropes, KV-shared layers, per-layer embeddings, sandwich norms, soft-capped logits and, with
enable_moe_block, GeGLU experts beside every layer's MLP (config.py says what each is; trunk.py, layers.py and
moe.py run them), read from Hugging Face checkpoints and llama.cpp's gemma4 GGUF files (gguf.py), with the
assistant Google ships beside each model (shipped_assistant.py)."""

from __future__ import annotations

from pathlib import Path

from specdecode.models.families.base import GGUFMeta, ModelFamily
from specdecode.models.families.gemma4 import config, tensors
from specdecode.models.families.gemma4.gguf import ARCHITECTURE, gemma4_config, gemma4_hf_name
from specdecode.models.families.gemma4.kernels import fix_gemma_layers, gemma_batch_invariant
from specdecode.models.families.gemma4.shipped_assistant import GemmaShippedAssistant
from specdecode.models.families.gemma4.trunk import GemmaTransformer
from specdecode.models.families.registry import register_family
from specdecode.models.formats.gguf_layout import GGUFLayout
from specdecode.models.model_config import ModelConfig


class Gemma4Family(ModelFamily):
    name = "gemma4"
    model_types = config.MODEL_TYPES
    gguf_architectures = {ARCHITECTURE: "gemma4"}
    not_supported = {"gemma4-assistant": "a Gemma 4 assistant, a drafter: load its model's own file, and name this "
                                         "one with --draft-model for --spec-type mtp"}
    cache_kind = "kv-shared"
    assistant = GemmaShippedAssistant()

    def config_from_hf(self, hf: dict, model_type: str) -> ModelConfig:
        return config.from_hf(hf, model_type)

    def config_to_hf(self, model_config: ModelConfig) -> dict:
        return config.to_hf(model_config)

    def config_from_gguf(self, meta: GGUFMeta, architecture: str, tensors_: dict, tokens: dict, path: Path,
                         companion: bool = False) -> ModelConfig:
        return gemma4_config(meta, tensors_, tokens.get("eos"), tokens.get("bos"))

    def sources(self, model_config: ModelConfig) -> dict[str, list[str]]:
        return tensors.gemma_sources(model_config)

    def shapes(self, model_config: ModelConfig) -> dict[str, tuple[int, ...]]:
        return tensors.gemma_shapes(model_config)

    def unread(self, model_config: ModelConfig, name: str) -> bool:
        """A multimodal checkpoint's towers, and the KV-shared layers' key and value weights nothing reads."""
        return name.startswith(tensors.NOT_TEXT_PREFIXES) or name in tensors.unread_names(model_config)

    def gguf_layout(self, model_config: ModelConfig, architecture: str) -> GGUFLayout:
        return GGUFLayout(gemma4_hf_name)  # norms stored as they are, nothing permuted

    def tokenizer_from_gguf_alone(self) -> bool:
        # transformers cannot read a gemma4 file's model config with the double-wide MLP (one feed-forward size per
        # layer); the tokenizer class itself reads the vocabulary alone.
        return True

    def build(self, model_config: ModelConfig) -> GemmaTransformer:
        return GemmaTransformer(model_config)

    def fuse_w4a8(self, model: GemmaTransformer) -> None:
        fix_gemma_layers(model)  # its w4a8 matmuls run from PyTorch, attention in the kernel where it can

    def fix_float(self, model: GemmaTransformer) -> str | None:
        return fix_gemma_layers(model)

    def batch_invariant(self, model: GemmaTransformer) -> bool:
        return gemma_batch_invariant(model)


register_family(Gemma4Family())
