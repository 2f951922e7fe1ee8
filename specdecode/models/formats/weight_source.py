"""Where a model's tensors come from, read a block of rows at a time: a Hugging Face-style folder or a GGUF file.

Reading by rows keeps a quantized load from ever holding a whole tensor in float32, let alone the model: a
block is dequantized, requantized and dropped before the next one is read, so the peak stays near the size of
the result (the 1.5B's is measured in docs/benchmarks/README.md). Both sources name tensors as Hugging Face does
(without "model."); which tensors a model needs is its family's to say (families/, model_files.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdecode.errors import SpecDecodeError
from specdecode.models.formats.gguf_int4 import q4_k_groups
from specdecode.models.formats.gguf_layout import GGUFLayout
from specdecode.models.formats.gguf_read import dequantize_tensor
from specdecode.models.formats.safetensors_read import read_header
from specdecode.models.model_config import ModelConfig

ALL_ROWS = slice(None)
_CHUNK_ELEMENTS = 1 << 23  # 32 MB of float32 per block of rows, whatever the row length


class FolderWeights:
    """The *.safetensors files of a Hugging Face-style folder, memory-mapped, tensors read on demand."""

    def __init__(self, files: list[Path]):
        self._handles = {}
        self._file_of: dict[str, tuple[Path, str]] = {}  # our key (no "model.") -> file and stored key
        for file in files:
            read_header(file)  # every entry checked against the file: safe_open is handed no crafted offsets
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as error:
                raise SpecDecodeError(f"{file} is corrupt or truncated ({error})") from None
            self._handles[file] = handle
            for key in handle.keys():
                # A multimodal checkpoint keeps its language model under model.language_model.
                self._file_of[key.removeprefix("model.").removeprefix("language_model.")] = (file, key)

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        file, key = self._file_of[name]
        return tuple(self._handles[file].get_slice(key).get_shape())

    def get(self, name: str, rows: slice = ALL_ROWS) -> torch.Tensor:
        """The tensor, or its rows `rows`, in the stored dtype."""
        file, key = self._file_of[name]
        try:
            handle = self._handles[file]
            return handle.get_tensor(key) if rows == ALL_ROWS else handle.get_slice(key)[rows]
        except (SafetensorError, OSError) as error:
            raise SpecDecodeError(f"{file} is corrupt or truncated ({error})") from None

    def is_q4_k(self, name: str) -> bool:
        return False  # safetensors hold float weights only


class GGUFWeights:
    """The tensors of a GGUF file under Hugging Face names, dequantized one at a time on demand."""

    def __init__(self, reader, config: ModelConfig, layout: GGUFLayout):
        """`reader`: the checked file (gguf_read.open_gguf); `config`: what its metadata says; `layout`: how
        its family stores tensors against Hugging Face's names and values (model_files.open_gguf_weights)."""
        self.reader = reader
        self.config = config
        self.layout = layout
        self._tensors = {layout.name(t.name): t for t in reader.tensors}
        # The vocabulary's arrays are never read from here (transformers builds the tokenizer from the file), and
        # parsed they hold a third of a GiB of small numpy objects for Qwen2.5's 151k tokens.
        fields = reader.fields
        for key in [key for key, field in fields.items() if key.startswith("tokenizer.ggml.") and len(field.data) > 1]:
            del fields[key]

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(int(d) for d in reversed(self._tensors[name].shape))  # GGUF lists dims innermost first
        return self.layout.shape(name, shape)

    def get(self, name: str, rows: slice = ALL_ROWS) -> torch.Tensor:
        """The tensor, or its rows `rows`, in float32 in PyTorch's [out, in] layout, with Hugging Face's values and
        row order."""
        tensor = self._tensors[name]
        if not self.layout.reorders(name):
            return torch.from_numpy(dequantize_tensor(tensor, rows))
        # Reordered or re-valued tensors (llama q/k rows, a qwen35 file's value heads and norms) are read whole;
        # they are among the smallest
        return self.layout.values(name, torch.from_numpy(dequantize_tensor(tensor)))[rows]

    def is_q4_k(self, name: str) -> bool:
        from gguf import GGMLQuantizationType

        return self._tensors[name].tensor_type == GGMLQuantizationType.Q4_K and self.layout.keeps_groups(name)

    def q4_k(self, name: str, rows: slice = ALL_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A Q4_K tensor's (or its rows') exact int4 groups: codes [N, K], scales and zeros [N, K/32]."""
        tensor = self._tensors[name]
        if not self.layout.reorders(name):
            return q4_k_groups(tensor, rows)
        return tuple(self.layout.rows(name, part)[rows] for part in q4_k_groups(tensor))


def stacked(source: FolderWeights | GGUFWeights, names: list[str]) -> torch.Tensor:
    """The tensors `names` stacked along dim 0, without a copy when there is only one."""
    parts = [source.get(n) for n in names]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def stacked_as(source: FolderWeights | GGUFWeights, names: list[str], dtype: torch.dtype) -> torch.Tensor:
    """`stacked(...).to(dtype)` without ever holding a whole tensor in float32 (the embedding's is 0.9 GB)."""
    shapes = [source.shape(n) for n in names]
    out = torch.empty(sum(s[0] for s in shapes), *shapes[0][1:], dtype=dtype)  # [N, ...]
    start = 0
    for chunk in row_blocks(source, names, source.get):
        out[start : start + len(chunk)] = chunk
        start += len(chunk)
    return out


def row_blocks(source: FolderWeights | GGUFWeights, names: list[str], read: Callable) -> Iterator:
    """`read(name, rows)` over the tensors `names` in stacking order, a block of about 32 MB of float32 rows
    at a time."""
    for name in names:
        shape = source.shape(name)
        step = max(64, _CHUNK_ELEMENTS // math.prod(shape[1:]) // 64 * 64)
        for start in range(0, shape[0], step):
            yield read(name, slice(start, min(start + step, shape[0])))
