"""A GGUF file read: its header checked, its metadata fields' values, its tensors dequantized into PyTorch's
[out, in] layout a block of rows at a time. What the tensors are (names, config, layout) is the family's to say
(families/, model_files.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specdecode.errors import SpecDecodeError
from specdecode.models.formats.gguf_header import read_header


def open_gguf(path: Path):
    """A GGUFReader over a checked file: a truncated, foreign or crafted file fails here with one clear message.

    gguf's reader believes every count and offset in the header (a crafted length is an OverflowError, a
    shape's element count wraps around in uint64): our own header parser checks them all against the file's
    size first (gguf_header.py)."""
    from gguf import GGUFReader

    read_header(path)
    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as error:
        # Whatever the reader refuses beyond our checks: still one message, not its traceback.
        raise SpecDecodeError(f"{path} is truncated or corrupt: not a readable GGUF file ({error})") from None


def field_value(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    if field.types and field.types[0].name == "STRING" and len(field.data) == 1:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    values = [field.parts[i].tolist() for i in field.data]
    values = [v[0] if isinstance(v, list) and len(v) == 1 else v for v in values]
    return values[0] if len(values) == 1 else values


def stored_float(value) -> float:
    """A float metadata value the file keeps in float32 (1.8 reads back as 1.7999999523), at float32's 7
    significant digits: the value the converter was given."""
    return float(f"{float(value):.7g}")


_DEQUANTIZE_ROWS = 4096  # gguf-py's dequantizers make several full-size temporaries: bound them by chunks


def dequantize_tensor(tensor, rows: slice = slice(None)) -> np.ndarray:
    """One GGUF tensor (or the rows `rows` of a 2-D one) -> float32 array in PyTorch's [out, in] layout,
    dequantized a chunk of rows at a time."""
    from gguf import dequantize

    data = tensor.data[rows]  # [rows, bytes per row] for quantized types, [rows, columns] otherwise
    if data.ndim < 2 or len(data) <= _DEQUANTIZE_ROWS:
        array = np.asarray(dequantize(data, tensor.tensor_type), dtype=np.float32)
        # Unquantized tensors come back as read-only views of the memory-mapped file; torch wants its own copy.
        return array if array.flags.writeable else array.copy()
    first = dequantize(data[:1], tensor.tensor_type)  # [1, columns]
    out = np.empty((len(data), first.shape[-1]), dtype=np.float32)  # [rows, columns]
    for start in range(0, len(data), _DEQUANTIZE_ROWS):
        out[start : start + _DEQUANTIZE_ROWS] = dequantize(data[start : start + _DEQUANTIZE_ROWS], tensor.tensor_type)
    return out
