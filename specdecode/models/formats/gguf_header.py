"""A GGUF file's tensor types, parameter count and vocabulary, read from its header alone, every field checked.

gguf's GGUFReader parses every metadata value, Qwen2.5's 151k-token vocabulary included (8 s for the default
target here); deciding how to load a file needs only the tensor infos after it, so this walks the header and
skips values by their sizes (0.1 s), reading the token strings only when asked.

A header is untrusted input: every count, length, type and offset is checked against the bytes the file has
before it is used, so a crafted header is one clear error rather than an overflow, a loop of 2**64 turns or a
read past the end. `read_header` is also the check run before gguf's own reader is handed a file
(gguf_read.open_gguf): that reader trusts what the header says.
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
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_SUPPORTED_VERSIONS = (2, 3)  # what gguf's reader reads: 64-bit counts, little-endian
_MOST_DIMENSIONS = 4  # GGML_MAX_DIMS: llama.cpp refuses a tensor with more
_MOST_ARRAY_NESTING = 8  # arrays of arrays: real files nest one deep; a crafted one must not exhaust the stack
_DEFAULT_ALIGNMENT = 32  # where the tensor data starts without general.alignment (the GGUF specification)
# The fewest bytes each item can take, to refuse a count that the rest of the file cannot hold before looping.
_LEAST_KEY_VALUE = 8 + 4 + 1  # an empty key's length, the value type, a one-byte value
_LEAST_TENSOR_INFO = 8 + 4 + 4 + 8  # an empty name's length, no dimensions, the type, the offset
TOKENS_KEY = "tokenizer.ggml.tokens"


@dataclass
class GGUFHeader:
    types: dict[str, gguf.GGMLQuantizationType]  # tensor name -> its GGML type
    parameters: int  # elements of every tensor
    tokens: list[str] | None  # the vocabulary by id, when asked for and present
    metadata: dict[str, int | float | bool | str]  # every key holding one number or string (arrays skipped)


class _Corrupt(ValueError):
    """A header field that the file cannot back: said in words a user can act on."""


def tensor_types(path: Path) -> dict[str, gguf.GGMLQuantizationType]:
    """Tensor name -> its GGML type, for every tensor of the file."""
    return read_header(path).types


def read_header(path: Path, with_tokens: bool = False) -> GGUFHeader:
    """The header of a GGUF file whose every field the file backs; one SpecDecodeError otherwise."""
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read(_Cursor(data), with_tokens)
    except (OSError, ValueError) as error:  # _Corrupt, an empty file (mmap), an unknown tensor type (the enum)
        if not _starts_with_magic(path):
            raise SpecDecodeError(f"{path} is not a GGUF file (it does not start with the GGUF magic)") from None
        raise SpecDecodeError(f"{path} is truncated or corrupt: not a readable GGUF file ({error})") from None


def _starts_with_magic(path: Path) -> bool:
    try:
        with path.open("rb") as file:
            return file.read(4) == b"GGUF"
    except OSError:
        return False


class _Cursor:
    """Reads a header front to back; nothing is read, and no count is looped over, before the bytes left in the
    file are known to hold it."""

    def __init__(self, data):
        self.data = data
        self.offset = 0

    @property
    def left(self) -> int:
        return len(self.data) - self.offset

    def skip(self, size: int, what: str) -> int:
        """Step over `size` bytes; -> where they start."""
        if size > self.left:
            raise _Corrupt(f"the file ends inside {what} at byte {self.offset}")
        self.offset += size
        return self.offset - size

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack_from(fmt, self.data, self.skip(struct.calcsize(fmt), what))

    def count(self, least_bytes_each: int, what: str) -> int:
        """A 64-bit count of items that take at least `least_bytes_each` bytes each."""
        (count,) = self.unpack("<Q", what)
        if count * least_bytes_each > self.left:
            raise _Corrupt(f"{what} is {count}, more than the {self.left} bytes after it can hold")
        return count

    def raw_string(self, what: str) -> bytes:
        length = self.count(1, f"the length of {what}")
        start = self.skip(length, what)
        return bytes(self.data[start:start + length])

    def string(self, what: str) -> str:
        return self.raw_string(what).decode("utf-8", "replace")

    def name(self, what: str) -> str:
        """A key or tensor name: gguf's reader decodes these strictly, so a name that is not UTF-8 is refused."""
        raw = self.raw_string(what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"{what} {raw[:40]!r} is not UTF-8") from None

    def skip_value(self, kind: int, what: str, depth: int = 0) -> None:
        if kind in _SCALAR_BYTES:
            self.skip(_SCALAR_BYTES[kind], what)
        elif kind == _STRING:
            self.skip(self.count(1, f"the length of {what}"), what)
        elif kind == _ARRAY:
            if depth >= _MOST_ARRAY_NESTING:
                raise _Corrupt(f"{what} nests arrays more than {_MOST_ARRAY_NESTING} deep")
            (element,) = self.unpack("<I", f"the element type of {what}")
            if element in _SCALAR_BYTES:
                size = _SCALAR_BYTES[element]
                self.skip(self.count(size, f"the length of {what}") * size, what)
                return
            least = {_STRING: 8, _ARRAY: 12}.get(element)
            if least is None:
                raise _Corrupt(f"{what} holds values of unknown GGUF type {element}")
            for _ in range(self.count(least, f"the length of {what}")):
                self.skip_value(element, what, depth + 1)
        else:
            raise _Corrupt(f"{what} has unknown GGUF value type {kind}")

    def string_array(self, what: str) -> list[str]:
        (element,) = self.unpack("<I", f"the element type of {what}")
        if element != _STRING:
            raise _Corrupt(f"{what} holds GGUF type {element}, not strings")
        return [self.string(what) for _ in range(self.count(8, f"the length of {what}"))]


def _read(cursor: _Cursor, with_tokens: bool) -> GGUFHeader:
    if cursor.unpack("4s", "the magic")[0] != b"GGUF":
        raise _Corrupt("no GGUF magic")
    (version,) = cursor.unpack("<I", "the version")
    if version not in _SUPPORTED_VERSIONS:
        raise _Corrupt(f"GGUF version {version} is not one this reads (2 or 3, little-endian)")
    (tensor_count,) = cursor.unpack("<Q", "the tensor count")
    kv_count = cursor.count(_LEAST_KEY_VALUE, "the metadata count")
    if tensor_count * _LEAST_TENSOR_INFO > cursor.left:
        raise _Corrupt(f"the tensor count is {tensor_count}, more than the rest of the file can describe")
    tokens, metadata, alignment, keys = None, {}, _DEFAULT_ALIGNMENT, set()
    for _ in range(kv_count):
        key = cursor.name("a metadata key")
        if key in keys:
            raise _Corrupt(f"metadata key {key!r} appears twice")
        keys.add(key)
        (kind,) = cursor.unpack("<I", f"the type of {key}")
        if with_tokens and key == TOKENS_KEY and kind == _ARRAY:
            tokens = cursor.string_array(key)
        elif kind in _SCALAR_FORMATS:
            (metadata[key],) = cursor.unpack(_SCALAR_FORMATS[kind], key)
        elif kind == _STRING:
            metadata[key] = cursor.string(key)
        else:
            cursor.skip_value(kind, key)
        if key == "general.alignment":
            alignment = metadata.get(key) if kind == _UINT32 else 0
            if not alignment or alignment & (alignment - 1):
                raise _Corrupt("general.alignment is not a power of two stored as uint32")
    tensors = [_tensor_info(cursor) for _ in range(tensor_count)]
    data_start = -(-cursor.offset // alignment) * alignment  # the tensor data begins at the next aligned byte
    types, parameters = {}, 0
    for name, kind, elements, offset in tensors:
        if name in types:
            raise _Corrupt(f"tensor {name!r} appears twice")
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        if data_start + offset + elements // block * block_bytes > len(cursor.data):
            raise _Corrupt(f"tensor {name} ends past the end of the file")
        types[name] = kind
        parameters += elements
    return GGUFHeader(types, parameters, tokens, metadata)


def _tensor_info(cursor: _Cursor) -> tuple[str, gguf.GGMLQuantizationType, int, int]:
    """One tensor's name, type, element count and data offset, its shape checked against its type."""
    name = cursor.name("a tensor name")
    (dimensions,) = cursor.unpack("<I", f"the dimension count of {name}")
    if dimensions > _MOST_DIMENSIONS:
        raise _Corrupt(f"tensor {name} has {dimensions} dimensions, more than GGUF's {_MOST_DIMENSIONS}")
    shape = cursor.unpack(f"<{dimensions}Q", f"the shape of {name}")  # innermost first
    kind_value, offset = cursor.unpack("<IQ", f"the type and offset of {name}")
    try:
        kind = gguf.GGMLQuantizationType(kind_value)
    except ValueError:
        raise _Corrupt(f"tensor {name} has unknown GGML type {kind_value}") from None
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if shape and shape[0] % block:
        raise _Corrupt(f"tensor {name}'s rows of {shape[0]} are not whole {kind.name} blocks of {block}")
    return name, kind, prod(shape), offset
