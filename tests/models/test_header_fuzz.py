"""Model files with crafted headers through every front door that opens one: `generate`, `inspect`, `models
--drafts-for` and `serve --model` each end in one `error:` line and exit 2, never a traceback.

The mutations are written, not drawn at random, so the set and its time stay the same from run to run: each
count, length, value type, dimension, tensor type and data offset of a small valid GGUF file (a few of each) set
to values the file cannot back, and each field of a small valid safetensors file's header likewise; plus the
issue's reproducer, random bytes after the GGUF magic, and headers cut short. Every one fails while the header is
read, before any weight is, so the whole set takes seconds.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest
from conftest import save_tiny_model
from gguf_files import write_gguf

from specdecode.cli import main

SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types
STRING, FIELDS_PER_KIND = 8, 3
# What each kind of GGUF field is set to: values no file of this size can back (huge counts and lengths, an
# unknown type, more dimensions than GGML has, data past the end). `None` stands for the file's own size.
GGUF_VALUES = {"count": (2**64 - 1, 2**63, None), "length": (2**64 - 1, 2**63, None),
               "value type": (13, 2**32 - 1), "dimensions": (5, 2**32 - 1), "dimension": (2**64 - 1, 2**63, None),
               "tensor type": (4, 2**32 - 1), "offset": (2**64 - 1, None)}
WIDTH = {4: "<I", 8: "<Q"}


def gguf_fields(data: bytes) -> dict[str, list[tuple[int, int]]]:
    """Where a GGUF header keeps each of its fields: kind -> [(byte offset, width)], in file order."""
    fields: dict[str, list[tuple[int, int]]] = {kind: [] for kind in GGUF_VALUES}
    tensor_count, kv_count = struct.unpack_from("<QQ", data, 8)
    fields["count"] += [(8, 8), (16, 8)]

    def string(at: int) -> int:
        fields["length"].append((at, 8))
        return at + 8 + struct.unpack_from("<Q", data, at)[0]

    def value(at: int, kind: int) -> int:
        if kind in SCALAR_BYTES:
            return at + SCALAR_BYTES[kind]
        if kind == STRING:
            return string(at)
        fields["value type"].append((at, 4))  # an array: its element type and length
        fields["count"].append((at + 4, 8))
        element, count = struct.unpack_from("<IQ", data, at)
        at += 12
        for _ in range(count):
            at = value(at, element)
        return at

    offset = 24
    for _ in range(kv_count):
        offset = string(offset)
        fields["value type"].append((offset, 4))
        offset = value(offset + 4, struct.unpack_from("<I", data, offset)[0])
    for _ in range(tensor_count):
        offset = string(offset)
        fields["dimensions"].append((offset, 4))
        (dimensions,) = struct.unpack_from("<I", data, offset)
        fields["dimension"] += [(offset + 4 + 8 * i, 8) for i in range(dimensions)]
        offset += 4 + 8 * dimensions
        fields["tensor type"].append((offset, 4))
        fields["offset"].append((offset + 4, 8))
        offset += 12
    return fields


def gguf_mutations(data: bytes) -> list[tuple[str, bytes]]:
    """(what was changed, the file's new bytes) for a few fields of each kind, and the whole-file cases."""
    chooser = random.Random(0)
    mutations = [("the issue's reproducer", b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2**64 - 1) + b"\0" * 64)]
    mutations += [(f"random bytes after the magic ({seed})", b"GGUF" + random.Random(seed).randbytes(1024))
                  for seed in range(2)]
    for kind, places in gguf_fields(data).items():
        chosen = [places[0], places[-1], *chooser.sample(places, min(len(places), FIELDS_PER_KIND - 2))]
        for offset, width in dict.fromkeys(chosen):
            for value in GGUF_VALUES[kind]:
                value = len(data) if value is None else value
                edited = data[:offset] + struct.pack(WIDTH[width], value) + data[offset + width:]
                mutations.append((f"{kind} at byte {offset} = {value}", edited))
    header_end = gguf_fields(data)["offset"][-1][0] + 8
    mutations += [(f"cut at byte {cut}", data[:cut]) for cut in (7, 20, header_end // 2, header_end - 1)]
    return mutations


def safetensors_mutations(data: bytes) -> list[tuple[str, bytes]]:
    """(what was changed, the file's new bytes): the header's length, a tensor entry's every field, the header
    as a whole."""
    (length,) = struct.unpack_from("<Q", data)
    header, body = json.loads(data[8:8 + length]), data[8 + length:]

    def with_header(edited) -> bytes:
        text = edited.encode() if isinstance(edited, str) else json.dumps(edited).encode()
        return struct.pack("<Q", len(text)) + text + body

    mutations = [(f"header length {value}", struct.pack("<Q", value) + data[8:])
                 for value in (2**64 - 1, 2**63, len(data), 0, 3)]
    names = sorted((name for name in header if name != "__metadata__"), key=lambda n: header[n]["data_offsets"])
    for name in (names[0], names[-1]):
        begin, end = header[name]["data_offsets"]
        shape = header[name]["shape"]
        edits = {"dtype": ["Q9", 7, None], "shape": [[-shape[0], *shape[1:]], [2**62] * 2, "64", [1.5], [True]],
                 "data_offsets": [[0, 2**64], [-8, end - begin - 8], [end, begin], [begin], "0",
                                  [begin, len(body) + 8]]}
        for field, values in edits.items():
            for value in values:
                entry = {key: v for key, v in header[name].items() if key != field or value is not None}
                if value is not None:
                    entry[field] = value
                mutations.append((f"{name} {field} = {value!r}", with_header(header | {name: entry})))
        mutations.append((f"{name} described by a number", with_header(header | {name: 5})))
    mutations += [("a header that is a list", with_header([])),
                  ("metadata that is not text to text", with_header(header | {"__metadata__": {"format": 1}})),
                  ("JSON nested past the parser's depth", with_header("[" * 100_000 + "]" * 100_000)),
                  ("the data cut short", data[:-100])]
    return mutations


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory) -> tuple[Path, Path]:
    """A small valid GGUF file and a small valid model folder."""
    root = tmp_path_factory.mktemp("header-fuzz")
    folder = save_tiny_model(root / "folder", "qwen2", scale=0.15)
    write_gguf(root / "model.gguf", folder, "qwen2")
    return root / "model.gguf", folder


FRONT_DOORS = {  # name -> its argv for a model path
    "generate": lambda model: ["generate", "hi", "--model", model, "--max-tokens", "2", "--dtype", "float32"],
    "inspect": lambda model: ["inspect", model],
    "models --drafts-for": lambda model: ["models", "--drafts-for", model],
    "serve --model": lambda model: ["serve", "--model", model, "--port", "0", "--dtype", "float32"],
}


def answers_with_one_error_line(argv: list[str], capsys, what: str) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, (what, argv[0], err)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, (what, argv[0], code, err)


@pytest.fixture
def no_default_models(monkeypatch):
    """No default model is looked at (or assembled) as a candidate draft: the file under test fails first anyway."""
    monkeypatch.setattr("specdecode.models.pairing.installed_defaults", lambda: [])
    monkeypatch.setattr("specdecode.cli.models.installed_defaults", lambda: [])


def test_crafted_gguf_headers_are_one_error_line_at_every_front_door(valid_files, tmp_path, capsys,
                                                                     no_default_models):
    original = valid_files[0].read_bytes()
    path = tmp_path / "crafted.gguf"
    for what, content in gguf_mutations(original):
        path.write_bytes(content)
        for door, argv in FRONT_DOORS.items():
            answers_with_one_error_line(argv(str(path)), capsys, what)


def test_crafted_safetensors_headers_are_one_error_line_at_every_front_door(valid_files, tmp_path, capsys,
                                                                            no_default_models):
    folder = Path(shutil.copytree(valid_files[1], tmp_path / "crafted"))
    original = (folder / "model.safetensors").read_bytes()
    for what, content in safetensors_mutations(original):
        (folder / "model.safetensors").write_bytes(content)
        for door, argv in FRONT_DOORS.items():
            answers_with_one_error_line(argv(str(folder)), capsys, what)
