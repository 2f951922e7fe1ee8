"""The Llama family's GGUF files (llama.cpp's `llama`, `qwen2` and `qwen3` architectures; Mistral is `llama`): the
shared Llama-style names (formats/gguf_names.py), and for the `llama` architecture the q/k rows its converter
interleaved, put back in Hugging Face order."""

from __future__ import annotations

import torch

from specdecode.models.formats.gguf_layout import GGUFLayout
from specdecode.models.formats.gguf_names import llama_style_name
from specdecode.models.model_config import ModelConfig


class LlamaLayout(GGUFLayout):
    def __init__(self, config: ModelConfig, architecture: str):
        super().__init__(llama_style_name)
        self.config = config
        self.permuted = architecture == "llama"  # only this architecture's converter interleaves q/k rows

    def heads(self, name: str) -> int | None:
        """How many heads the file interleaved tensor `name`'s rows over, or None (rows in Hugging Face order)."""
        if self.permuted and ".q_proj." in name:
            return self.config.num_heads
        if self.permuted and ".k_proj." in name:
            return self.config.num_kv_heads
        return None

    def reorders(self, name: str) -> bool:
        return self.heads(name) is not None

    def rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        heads = self.heads(name)
        return tensor if heads is None else unpermute_llama_qk(tensor, heads)


def unpermute_llama_qk(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves rotary halves of q/k rows for the llama architecture; undo that.

    Its permute views each head's rows as [2, D/2] and swaps to [D/2, 2]; the inverse views them as [D/2, 2].
    """
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
