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


# transformers 5's fused experts ([E, 2I, H] gate then up rows; [E, H, I]) -> the per-expert tensors they stack,
# each (its name after "experts.{e}.", which part of the expert's rows: 0 = the first half, 1 = the second, None =
# all of them)
FUSED_EXPERTS = {"experts.gate_up_proj": (("gate_proj.weight", 0), ("up_proj.weight", 1)),
                 "experts.down_proj": (("down_proj.weight", None),)}


class FolderWeights:
    """The *.safetensors files of a Hugging Face-style folder, memory-mapped, tensors read on demand.

    Experts stored fused (transformers 5's `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I])
    are read under the per-expert names published checkpoints use (`experts.{e}.gate_proj.weight` [I, H], ...),
    so a family names experts one way whichever layout a folder holds."""

    def __init__(self, files: list[Path]):
        self._handles = {}
        self._file_of: dict[str, tuple[Path, str]] = {}  # our key (no "model.") -> file and stored key
        # a per-expert name read from a fused tensor -> (expert, first row, rows) in it
        self._expert_rows: dict[str, tuple[int, int, int]] = {}
        self._fused: set[str] = set()  # the fused experts tensors read under per-expert names
        for file in files:
            read_header(file)  # every entry checked against the file: safe_open is handed no crafted offsets
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as error:
                raise SpecDecodeError(f"{file} is corrupt or truncated ({error})") from None
            self._handles[file] = handle
            for key in handle.keys():
                # A multimodal checkpoint keeps its language model under model.language_model.
                name = key.removeprefix("model.").removeprefix("language_model.")
                self._file_of[name] = (file, key)
                self._split_experts(name, handle.get_slice(key).get_shape())

    def _split_experts(self, name: str, shape: list[int]) -> None:
        """Name each expert's part of a fused experts tensor `name` of `shape` (anything else is left alone)."""
        prefix, dot, stem = name.rpartition("experts.")
        parts = FUSED_EXPERTS.get(dot + stem)
        if parts is None or len(shape) != 3:
            return
        self._fused.add(name)
        rows = shape[1] // len(parts)
        for expert in range(shape[0]):
            for part, half in parts:
                per_expert = f"{prefix}experts.{expert}.{part}"
                self._file_of[per_expert] = self._file_of[name]
                self._expert_rows[per_expert] = (expert, (half or 0) * rows, rows)

    def names(self) -> set[str]:
        """Every tensor's name; a fused experts tensor's under its per-expert names only."""
        return set(self._file_of) - self._fused

    def shape(self, name: str) -> tuple[int, ...]:
        file, key = self._file_of[name]
        shape = tuple(self._handles[file].get_slice(key).get_shape())
        return (self._expert_rows[name][2], shape[2]) if name in self._expert_rows else shape

    def get(self, name: str, rows: slice = ALL_ROWS) -> torch.Tensor:
        """The tensor, or its rows `rows`, in the stored dtype."""
        file, key = self._file_of[name]
        try:
            handle = self._handles[file]
            if name in self._expert_rows:
                expert, first, count = self._expert_rows[name]
                start, stop, _ = rows.indices(count)
                return handle.get_slice(key)[expert : expert + 1, first + start : first + stop][0]
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
        self._tensors = {}
        for tensor in reader.tensors:
            name = layout.name(tensor.name)
            if EXPERT in name:  # llama.cpp's `*_exps` [E, rows, columns]: read as one tensor per expert
                self._tensors.update(expert_slices(name, tensor))
            else:
                self._tensors[name] = tensor
        # Tensors stored in parts, read whole and joined by the layout: name -> the parts, in order
        self._parts = {name: [self._tensors.pop(part) for part in parts]
                       for name, parts in layout.joined(set(self._tensors)).items()}
        self._joined_shapes: dict[str, tuple[int, ...]] = {}
        # The vocabulary's arrays are never read from here (transformers builds the tokenizer from the file), and
        # parsed they hold a third of a GiB of small numpy objects for Qwen2.5's 151k tokens.
        fields = reader.fields
        for key in [key for key, field in fields.items() if key.startswith("tokenizer.ggml.") and len(field.data) > 1]:
            del fields[key]

    def names(self) -> set[str]:
        return set(self._tensors) | set(self._parts)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._parts:  # known once joined (the parts are small: a layer's latent up-projections)
            if name not in self._joined_shapes:
                self._joined_shapes[name] = tuple(self.get(name).shape)
            return self._joined_shapes[name]
        shape = tuple(int(d) for d in reversed(self._tensors[name].shape))  # GGUF lists dims innermost first
        return self.layout.shape(name, shape)

    def get(self, name: str, rows: slice = ALL_ROWS) -> torch.Tensor:
        """The tensor, or its rows `rows`, in float32 in PyTorch's [out, in] layout, with Hugging Face's values and
        row order."""
        if name in self._parts:
            parts = [torch.from_numpy(dequantize_tensor(part)) for part in self._parts[name]]
            return self.layout.join(name, parts)[rows]
        tensor = self._tensors[name]
        if not self.layout.reorders(name):
            return torch.from_numpy(dequantize_tensor(tensor, rows))
        # Reordered or re-valued tensors (llama q/k rows, a qwen35 file's value heads and norms) are read whole;
        # they are among the smallest
        return self.layout.values(name, torch.from_numpy(dequantize_tensor(tensor)))[rows]

    def is_q4_k(self, name: str) -> bool:
        from gguf import GGMLQuantizationType

        if name in self._parts:
            return False  # joined from dequantized parts
        return self._tensors[name].tensor_type == GGMLQuantizationType.Q4_K and self.layout.keeps_groups(name)

    def q4_k(self, name: str, rows: slice = ALL_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A Q4_K tensor's (or its rows') exact int4 groups: codes [N, K], scales and zeros [N, K/32]."""
        tensor = self._tensors[name]
        if not self.layout.reorders(name):
            return q4_k_groups(tensor, rows)
        return tuple(self.layout.rows(name, part)[rows] for part in q4_k_groups(tensor))


EXPERT = "{expert}"  # in a layout's name for a tensor stacking every expert's: where the expert's index goes


# A layout's name ending for experts' gate and up projections stored in one tensor (llama.cpp's ffn_gate_up_exps,
# [E, 2I, H]: every gate row, then every up row, as transformers' gate_up_proj), read as the two halves' names.
FUSED_GATE_UP = ("gate_up_proj.weight", ("gate_proj.weight", "up_proj.weight"))


class ExpertSlice:
    """One expert's part of a GGUF tensor of experts (or a block of its rows), shaped and read as a 2-D tensor of
    its own."""

    def __init__(self, tensor, expert: int, rows: slice = ALL_ROWS):
        self.data = tensor.data[expert][rows]  # [rows, bytes per row] (quantized) or [rows, columns]
        self.tensor_type = tensor.tensor_type
        self.shape = (tensor.shape[0], len(self.data))  # GGUF lists dims innermost first: (columns, rows)


def expert_slices(name: str, tensor) -> dict[str, ExpertSlice]:
    """A GGUF tensor of experts, named `name` with EXPERT where the index goes -> each expert's tensor by name; a
    fused gate and up projection (FUSED_GATE_UP) as each expert's two halves."""
    experts = range(int(tensor.shape[-1]))
    fused, halves = FUSED_GATE_UP
    if not name.endswith(fused):
        return {name.replace(EXPERT, str(e)): ExpertSlice(tensor, e) for e in experts}
    stem, rows = name.removesuffix(fused), int(tensor.shape[1]) // 2
    return {stem.replace(EXPERT, str(e)) + half: ExpertSlice(tensor, e, slice(i * rows, (i + 1) * rows))
            for e in experts for i, half in enumerate(halves)}


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
