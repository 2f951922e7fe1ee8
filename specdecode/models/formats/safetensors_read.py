"""Read a safetensors file's header, checked against the file, and its tensors into allocations of their own.

`safe_open` maps the file: every page read stays in this process's resident memory until the mapping closes,
so reading a 1.3 GB quantized model into copies (the kernels want their own aligned allocations) peaked at the
copies plus the mapped file, 2.6 GB for 1.3 GB of weights. Reading each tensor's bytes with plain file reads
into its own allocation goes through the page cache, which is the kernel's, not the process's.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON header
mapping each name to its dtype, shape and byte offsets within the data that follows (and an optional
`__metadata__` entry), then the data. A header is untrusted input: `read_header` checks every entry's dtype,
shape and offsets against the bytes the file has, so a crafted one is one clear error before any allocation
or read (and before `safe_open` is handed the file: weight_source.FolderWeights).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
          "BOOL": torch.bool}
# Every dtype the format names that a header may hold (safe_open reads more than read_tensors does), by size.
ELEMENT_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
                 "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}
_MOST_HEADER_BYTES = 100 << 20  # the format's own limit


@dataclass(frozen=True)
class TensorEntry:
    dtype: str  # a key of ELEMENT_BYTES
    shape: tuple[int, ...]
    begin: int  # where its bytes start and end, from the start of the data after the header
    end: int


class _Corrupt(ValueError):
    """A header entry the file cannot back."""


def read_header(path: Path) -> tuple[dict[str, TensorEntry], int]:
    """Every tensor's entry, and where the data starts in the file; a SpecDecodeError naming the file if the
    header is not one the file backs (cut short, not JSON, an unknown dtype, a shape and offsets that disagree or
    point past the data)."""
    try:
        return _checked_header(path)
    except (OSError, ValueError) as error:
        raise SpecDecodeError(f"{path} is corrupt or truncated ({error})") from None


def read_tensors(path: Path, mapped: Callable[[str], bool] = lambda name: False) -> dict[str, torch.Tensor]:
    """Every tensor of `path` (a file this package wrote: a quantized copy in the cache), each in its own
    allocation, except those `mapped` names: views into one private mapping of the file, whose pages are read
    when first touched and which the system may drop again under memory pressure (a mixture of experts' experts:
    most of them idle at any moment). A SpecDecodeError naming the file if it is not a well-formed safetensors
    file (read_header's checks, a dtype read_tensors has no PyTorch type for)."""
    tensors = {}
    try:
        entries, data_start = _checked_header(path)
        unknown = sorted({entry.dtype for entry in entries.values()} - DTYPES.keys())
        if unknown:
            raise _Corrupt(f"dtype {unknown[0]} is not one read here")
        mapping = None  # the file's bytes, mapped copy-on-write: nothing a process does reaches the file
        with open(path, "rb") as file:
            for name, entry in sorted(entries.items(), key=lambda item: item[1].begin):
                if mapped(name) and entry.end > entry.begin:
                    if mapping is None:
                        mapping = torch.UntypedStorage.from_file(str(path), False, file.seek(0, 2))
                    raw = torch.empty(0, dtype=torch.uint8).set_(mapping, data_start + entry.begin,
                                                                 (entry.end - entry.begin,))  # [bytes]
                else:
                    raw = torch.empty(entry.end - entry.begin, dtype=torch.uint8)  # [bytes]
                    file.seek(data_start + entry.begin)
                    if len(raw) and file.readinto(memoryview(raw.numpy())) != len(raw):
                        raise _Corrupt(f"{name} is cut short")
                tensors[name] = raw.view(DTYPES[entry.dtype]).reshape(entry.shape)
    except (OSError, ValueError, RuntimeError) as error:  # RuntimeError: a mapping torch could not make
        raise SpecDecodeError(f"{path} is corrupt or truncated ({error}); delete it to rebuild") from None
    return tensors


def _checked_header(path: Path) -> tuple[dict[str, TensorEntry], int]:
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        file.seek(0)
        (header_bytes,) = struct.unpack("<Q", _read_exactly(file, 8))
        if header_bytes > min(_MOST_HEADER_BYTES, size - 8):
            raise _Corrupt(f"a header of {header_bytes} bytes in a file of {size}")
        try:
            header = json.loads(_read_exactly(file, header_bytes))
        except RecursionError:  # JSON nested deeper than the parser goes
            raise _Corrupt("its header nests JSON too deep") from None
    return _entries(header, size - 8 - header_bytes), 8 + header_bytes


def _read_exactly(file, count: int) -> bytes:
    data = file.read(count)
    if len(data) != count:
        raise _Corrupt("the file ends early")
    return data


def _entries(header: object, data_bytes: int) -> dict[str, TensorEntry]:
    if not isinstance(header, dict):
        raise _Corrupt("its header is not a JSON object")
    entries = {}
    for name, entry in header.items():
        if name == "__metadata__":  # the format's free text, which safe_open refuses in any other shape
            if not (isinstance(entry, dict) and all(isinstance(value, str) for value in entry.values())):
                raise _Corrupt("its __metadata__ is not an object of text values")
            continue
        if not isinstance(entry, dict):
            raise _Corrupt(f"{name!r} is not described by a JSON object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in ELEMENT_BYTES:
            raise _Corrupt(f"{name!r} has unknown dtype {json.dumps(dtype)[:40]}")
        if not _whole_numbers(shape):
            raise _Corrupt(f"{name!r} has shape {json.dumps(shape)[:80]}, not a list of sizes")
        if not (_whole_numbers(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1] <= data_bytes):
            raise _Corrupt(f"{name!r} has data offsets {json.dumps(offsets)[:80]}, not [begin, end] within the "
                           f"{data_bytes} bytes of data")
        expected = prod(shape) * ELEMENT_BYTES[dtype]
        if offsets[1] - offsets[0] != expected:
            raise _Corrupt(f"{name!r} holds {offsets[1] - offsets[0]} bytes, its shape needs {expected}")
        entries[name] = TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])
    return entries


def _whole_numbers(value: object) -> bool:
    """A JSON list of non-negative integers (true and false are not sizes)."""
    return isinstance(value, list) and all(type(item) is int and item >= 0 for item in value)
