"""`specdecode models --drafts-for M`: which models can draft for M, read from headers and tokenizer files."""

from __future__ import annotations

import gguf
import pytest
from conftest import save_tiny_model
from gguf_files import write_gguf

from specdecode.cli.main import main
from specdecode.models.formats.gguf_header import read_header
from specdecode.models.loader import load_model
from specdecode.models.pairing import model_facts, pair


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A target GGUF, a smaller GGUF with its vocabulary, and a folder whose tokenizer lists fewer tokens."""
    root = tmp_path_factory.mktemp("pairing")
    target = save_tiny_model(root / "target-hf", "qwen2", num_hidden_layers=4)
    small = save_tiny_model(root / "small-hf", "qwen2", num_hidden_layers=1)
    write_gguf(root / "target.gguf", target, "qwen2")
    write_gguf(root / "small.gguf", small, "qwen2")
    return {"target": root / "target.gguf", "small": root / "small.gguf", "folder": small}


def test_the_header_gives_the_vocabulary_the_loader_builds_and_every_weight(files):
    header = read_header(files["target"], with_tokens=True)
    loaded = load_model(files["target"], dtype="float32", quant="none")
    assert header.tokens == loaded.tokenizer.token_strings()  # the rule `draft` enforces, on the same strings
    reader = gguf.GGUFReader(files["target"])
    assert header.parameters == sum(int(t.n_elements) for t in reader.tensors)
    assert read_header(files["target"]).tokens is None  # not read unless asked


def test_pairing_verdicts(files):
    target, small, folder = (model_facts(str(files[k])) for k in ("target", "small", "folder"))
    forward = pair(target, small)
    assert forward.can_draft and 0 < forward.ratio < 0.5 and forward.note == "same vocabulary"
    backward = pair(small, target)
    assert not backward.can_draft and backward.note == "not smaller than the target"
    # The GGUF pads its token list to the embedding rows; the folder's tokenizer does not: `draft` refuses it.
    other = pair(target, folder)
    assert not other.can_draft and other.note.startswith("vocabulary differs")


def test_drafts_for_lists_candidates_and_the_command(files, capsys, monkeypatch):
    monkeypatch.setattr("specdecode.cli.models.installed_defaults", lambda: [])  # no default model assembled
    code = main(["models", "--drafts-for", str(files["target"]), "--candidate", str(files["folder"]),
                 "--candidate", str(files["small"])])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    assert "can draft" in lines[1] and str(files["small"]) in lines[1]  # usable ones first
    assert "cannot" in lines[2] and "vocabulary differs" in lines[2]
    assert f"--draft-model {files['small']}" in lines[-1]


def test_drafts_for_an_unknown_model_is_one_clear_error(capsys, monkeypatch):
    monkeypatch.setattr("specdecode.cli.models.installed_defaults", lambda: [])
    code = main(["models", "--drafts-for", "no-such-model"])
    err = capsys.readouterr().err
    assert code == 2 and "unknown model 'no-such-model'" in err and "Traceback" not in err
