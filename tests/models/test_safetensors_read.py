"""Our safetensors reader (one copy, no mapping): what safetensors writes reads back bitwise, and a damaged file
is one clear error."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from specdecode import SpecDecodeError
from specdecode.models.formats.safetensors_read import read_tensors


def test_every_dtype_reads_back_bitwise_in_its_own_aligned_memory(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5, generator=generator).to(torch.bfloat16),
        "f32": torch.randn(7, generator=generator),
        "f16": torch.randn(2, 2, generator=generator).to(torch.float16),
        "u8": torch.randint(0, 255, (4, 8, 2), generator=generator, dtype=torch.uint8),
        "i32": torch.randint(-9, 9, (6,), generator=generator, dtype=torch.int32),
        "i64": torch.randint(-9, 9, (1, 3), generator=generator),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    read = read_tensors(path)
    assert read.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert read[name].dtype == tensor.dtype and read[name].shape == tensor.shape and torch.equal(read[name], tensor)
        assert read[name].data_ptr() % 64 == 0 or read[name].numel() == 0


def damaged(tmp_path, cut: int = 0, header: object | None = None):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(path))
    data = path.read_bytes()
    if header is not None:
        text = json.dumps(header).encode()
        data = struct.pack("<Q", len(text)) + text + data[8 + struct.unpack("<Q", data[:8])[0]:]
    path.write_bytes(data[: len(data) - cut])
    return path


@pytest.mark.parametrize("case", [
    {"cut": 100},  # the data cut short
    {"cut": 16_400},  # into the header
    {"header": ["not", "an", "object"]},
    {"header": {"w": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 100]}}},  # wrong byte count
    {"header": {"w": {"dtype": "Q9", "shape": [64, 64], "data_offsets": [0, 16384]}}},  # unknown dtype
])
def test_a_damaged_file_is_one_clear_error(tmp_path, case):
    path = damaged(tmp_path, **case)
    with pytest.raises(SpecDecodeError, match="model.safetensors is corrupt or truncated"):
        read_tensors(path)
