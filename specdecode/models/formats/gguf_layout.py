"""How one GGUF file stores a model's tensors, against the Hugging Face names and values a family's tensor maps
use. llama.cpp's converters rename every tensor and, for some architectures, reorder rows (a llama file's q/k
heads) or change values (a qwen35 file's norms stored as 1 + w); a family's layout undoes that, so the rest of the
loader reads a GGUF file as it reads a Hugging Face folder. This base renames only."""

from __future__ import annotations

from collections.abc import Callable

import torch


class GGUFLayout:
    def __init__(self, names: Callable[[str], str]):
        """`names`: a GGUF tensor name -> its Hugging Face name (with or without "model.")."""
        self.names = names

    def name(self, gguf_name: str) -> str:
        return self.names(gguf_name).removeprefix("model.")

    def shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face shape of tensor `name`, stored with `shape` (rows first)."""
        return shape

    def reorders(self, name: str) -> bool:
        """Whether the file stores tensor `name` otherwise than Hugging Face does (rows moved or values changed):
        such a tensor is read whole, then converted."""
        return False

    def rows(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Per-row data of tensor `name` (a weight, bias, or int4 codes and scales) -> Hugging Face's row order."""
        return tensor

    def values(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A whole tensor as the file stores it (float32, [out, in]) -> Hugging Face's values and order."""
        return self.rows(name, tensor)

    def joined(self, names: set[str]) -> dict[str, tuple[str, ...]]:
        """Hugging Face tensors the file stores in parts (a deepseek2 file's kv_b_proj as attn_k_b and attn_v_b),
        found among `names` (as `name` gives them): each one's name -> its parts' names, in join's order."""
        return {}

    def join(self, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """Tensor `name` from its parts, each read whole as the file stores it (float32, PyTorch's dim order)."""
        raise NotImplementedError(f"{type(self).__name__} joins no tensors")

    def keeps_groups(self, name: str) -> bool:
        """Whether a Q4_K tensor's 32-column groups stay whole once read back (its columns are not moved), so its
        codes can be taken as they are."""
        return True
