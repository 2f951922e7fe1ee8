"""A GGUF file's tensor types, read from its header alone.

gguf's GGUFReader parses every metadata value, Qwen2.5's 151k-token vocabulary included (8 s for the default
target here); deciding how to load a file needs only the tensor infos after it, so this walks the header and
skips values by their sizes (0.1 s).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import gguf

from specdecode.errors import SpecDecodeError

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_STRING, _ARRAY = 8, 9


def tensor_types(path: Path) -> dict[str, gguf.GGMLQuantizationType]:
    """Tensor name -> its GGML type, for every tensor of the file."""
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read(data)
    except (OSError, ValueError, struct.error, IndexError) as error:
        raise SpecDecodeError(f"{path} is not a readable GGUF file ({error})") from None


def _read(data) -> dict[str, gguf.GGMLQuantizationType]:
    if data[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} predates 64-bit counts")
    offset = 24
    for _ in range(kv_count):
        offset = _skip_string(data, offset)  # the key
        (kind,) = struct.unpack_from("<I", data, offset)
        offset = _skip_value(data, offset + 4, kind)
    types = {}
    for _ in range(tensor_count):
        (length,) = struct.unpack_from("<Q", data, offset)
        name = bytes(data[offset + 8:offset + 8 + length]).decode("utf-8", "replace")
        offset += 8 + length
        (dims,) = struct.unpack_from("<I", data, offset)
        offset += 4 + 8 * dims
        kind, _ = struct.unpack_from("<IQ", data, offset)
        offset += 12
        types[name] = gguf.GGMLQuantizationType(kind)
    return types


def _skip_string(data, offset: int) -> int:
    (length,) = struct.unpack_from("<Q", data, offset)
    return offset + 8 + length


def _skip_value(data, offset: int, kind: int) -> int:
    if kind in _SCALAR_BYTES:
        return offset + _SCALAR_BYTES[kind]
    if kind == _STRING:
        return _skip_string(data, offset)
    if kind == _ARRAY:
        element, count = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if element in _SCALAR_BYTES:
            return offset + count * _SCALAR_BYTES[element]
        for _ in range(count):
            offset = _skip_value(data, offset, element)
        return offset
    raise ValueError(f"unknown GGUF value type {kind}")
