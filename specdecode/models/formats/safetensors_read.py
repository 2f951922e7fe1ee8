"""Read a whole safetensors file into tensors of their own, one copy and no mapping.

`safe_open` maps the file: every page read stays in this process's resident memory until the mapping closes,
so reading a 1.3 GB quantized model into copies (the kernels want their own aligned allocations) peaked at the
copies plus the mapped file, 2.6 GB for 1.3 GB of weights. Reading each tensor's bytes with plain file reads
into its own allocation goes through the page cache, which is the kernel's, not the process's.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length, a JSON header
mapping each name to its dtype, shape and byte offsets within the data that follows (and an optional
`__metadata__` entry), then the data.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
          "BOOL": torch.bool}
_MOST_HEADER_BYTES = 100 << 20  # the format's own limit


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `path`, each in its own allocation; a SpecDecodeError naming the file if it is not a
    well-formed safetensors file (truncated, a header that is not JSON, offsets past the data, unknown dtypes)."""
    try:
        with open(path, "rb") as file:
            header_bytes = struct.unpack("<Q", _read_exactly(file, 8))[0]
            if header_bytes > _MOST_HEADER_BYTES:
                raise ValueError(f"a header of {header_bytes} bytes")
            header = json.loads(_read_exactly(file, header_bytes))
            data_start = 8 + header_bytes
            tensors = {}
            for name, entry in sorted(_entries(header), key=lambda item: item[1]["data_offsets"][0]):
                begin, end = entry["data_offsets"]
                dtype = DTYPES[entry["dtype"]]
                shape = [int(size) for size in entry["shape"]]
                expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                if end - begin != expected:
                    raise ValueError(f"{name} holds {end - begin} bytes, its shape needs {expected}")
                raw = torch.empty(expected, dtype=torch.uint8)  # [bytes]
                file.seek(data_start + begin)
                if expected and file.readinto(memoryview(raw.numpy())) != expected:
                    raise ValueError(f"{name} is cut short")
                tensors[name] = raw.view(dtype).reshape(shape)
            return tensors
    except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
        raise SpecDecodeError(f"{path} is corrupt or truncated ({error}); delete it to rebuild") from None


def _read_exactly(file, count: int) -> bytes:
    data = file.read(count)
    if len(data) != count:
        raise ValueError("the file ends early")
    return data


def _entries(header: object) -> list[tuple[str, dict]]:
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return [(name, entry) for name, entry in header.items() if name != "__metadata__"]
