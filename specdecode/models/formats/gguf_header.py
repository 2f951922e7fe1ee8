"""A GGUF file's tensor types, parameter count and vocabulary, read from its header alone.

gguf's GGUFReader parses every metadata value, Qwen2.5's 151k-token vocabulary included (8 s for the default
target here); deciding how to load a file needs only the tensor infos after it, so this walks the header and
skips values by their sizes (0.1 s), reading the token strings only when asked.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import gguf

from specdecode.errors import SpecDecodeError

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_STRING, _ARRAY = 8, 9
TOKENS_KEY = "tokenizer.ggml.tokens"


@dataclass
class GGUFHeader:
    types: dict[str, gguf.GGMLQuantizationType]  # tensor name -> its GGML type
    parameters: int  # elements of every tensor
    tokens: list[str] | None  # the vocabulary by id, when asked for and present
    metadata: dict[str, int | float | bool | str]  # every key holding one number or string (arrays skipped)


def tensor_types(path: Path) -> dict[str, gguf.GGMLQuantizationType]:
    """Tensor name -> its GGML type, for every tensor of the file."""
    return read_header(path).types


def read_header(path: Path, with_tokens: bool = False) -> GGUFHeader:
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read(data, with_tokens)
    except (OSError, ValueError, struct.error, IndexError) as error:
        if not _starts_with_magic(path):
            raise SpecDecodeError(f"{path} is not a GGUF file (it does not start with the GGUF magic)") from None
        raise SpecDecodeError(f"{path} is truncated or corrupt: not a readable GGUF file ({error})") from None


def _starts_with_magic(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            return file.read(4) == b"GGUF"
    except OSError:
        return False


def _read(data, with_tokens: bool) -> GGUFHeader:
    if data[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
    if version < 2:
        raise ValueError(f"GGUF version {version} predates 64-bit counts")
    offset, tokens, metadata = 24, None, {}
    for _ in range(kv_count):
        key, offset = _string(data, offset)
        (kind,) = struct.unpack_from("<I", data, offset)
        if with_tokens and key == TOKENS_KEY and kind == _ARRAY:
            tokens, offset = _string_array(data, offset + 4)
        elif kind in _SCALAR_FORMATS:
            (metadata[key],) = struct.unpack_from(_SCALAR_FORMATS[kind], data, offset + 4)
            offset += 4 + _SCALAR_BYTES[kind]
        elif kind == _STRING:
            metadata[key], offset = _string(data, offset + 4)
        else:
            offset = _skip_value(data, offset + 4, kind)
    types, parameters = {}, 0
    for _ in range(tensor_count):
        name, offset = _string(data, offset)
        (dims,) = struct.unpack_from("<I", data, offset)
        parameters += prod(struct.unpack_from(f"<{dims}Q", data, offset + 4))
        offset += 4 + 8 * dims
        kind, _ = struct.unpack_from("<IQ", data, offset)
        offset += 12
        types[name] = gguf.GGMLQuantizationType(kind)
    return GGUFHeader(types, parameters, tokens, metadata)


def _string(data, offset: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", data, offset)
    return bytes(data[offset + 8:offset + 8 + length]).decode("utf-8", "replace"), offset + 8 + length


def _string_array(data, offset: int) -> tuple[list[str], int]:
    element, count = struct.unpack_from("<IQ", data, offset)
    if element != _STRING:
        raise ValueError(f"{TOKENS_KEY} holds GGUF type {element}, not strings")
    offset += 12
    strings = []
    for _ in range(count):
        text, offset = _string(data, offset)
        strings.append(text)
    return strings, offset


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
