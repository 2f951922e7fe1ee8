"""--spec-type auto: what it finds for a target, the line it prints, and that its chain stays lossless."""

from __future__ import annotations

import pytest
from conftest import TINY_VOCAB, save_tiny_model
from eagle3_reference import head_config, random_head, write_head

from specdecode import SpecConfig
from specdecode.auto_method import choose, head_folder
from specdecode.bench.suite import parse_methods
from specdecode.cli.main import main
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache folder of the test's own, and no installed default models unless a test says otherwise (pairing a
    tiny target with the real defaults would assemble them)."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("specdecode.models.pairing.installed_defaults", lambda: [])
    return tmp_path / "cache"


@pytest.fixture
def tiny_target(tmp_path):
    return save_tiny_model(tmp_path / "tiny-target", "llama", scale=0.2, num_hidden_layers=8)


def write_trained_head(target) -> None:
    """A head where `specdecode train eagle3` writes one for `target` by default."""
    weights = random_head(64, TINY_VOCAB, draft_ids=list(range(0, TINY_VOCAB, 3)))
    write_head(head_folder(str(target)), weights, head_config(weights, TINY_VOCAB, "reference", [2, 4, 5]),
               "reference")


def test_what_auto_finds(cache, tiny_target, monkeypatch):
    alone = choose(str(tiny_target), None, None)
    assert (alone.method, alone.draft_model, alone.draft_head) == ("suffix", None, None)
    assert "no MTP layers, EAGLE-3 head or draft model found" in alone.reason
    given = choose(str(tiny_target), "some-draft", None)
    assert (given.method, given.draft_model) == ("suffix,draft", "some-draft")
    write_trained_head(tiny_target)
    found = choose(str(tiny_target), None, None)
    assert found.method == "suffix,eagle3" and found.draft_head == str(cache / "eagle3" / "tiny-target")
    assert "EAGLE-3 head found at" in found.line() and found.line().startswith("auto: suffix,eagle3")
    assert choose(str(tiny_target), None, "/elsewhere").draft_head == "/elsewhere"  # a given head wins
    # METHOD=PATH pairs: an MTP companion named for mtp joins, and the head found beside it is kept.
    paired = choose(str(tiny_target), None, "mtp=/x/mtp-m.gguf")
    assert paired.method == "suffix,mtp,eagle3"
    assert paired.draft_head == f"mtp=/x/mtp-m.gguf,eagle3={cache / 'eagle3' / 'tiny-target'}"
    assert "MTP layers given at /x/mtp-m.gguf" in paired.reason
    assert choose(str(tiny_target), None, "eagle3=/h").draft_head == "eagle3=/h"
    assert head_folder(None) == cache / "eagle3" / DEFAULT_TARGET
    assert head_folder("/models/x-q4_k_m.gguf") == cache / "eagle3" / "x-q4_k_m"
    # The default target pairs with the default draft when its package is installed.
    monkeypatch.setattr("specdecode.models.pairing.installed_defaults", lambda: [DEFAULT_DRAFT])
    assert choose(None, None, None).draft_model == DEFAULT_DRAFT


def test_auto_generates_what_plain_decoding_does(cache, tiny_target, capsys):
    write_trained_head(tiny_target)
    args = ["generate", "abcabcabc", "--model", str(tiny_target), "--max-tokens", "12", "--ignore-eos",
            "--dtype", "float32", "--quant", "none", "--spec-type", "auto", "--compare-plain"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "auto: suffix,eagle3 with per-step choice" in err and "identical output: True" in err


def test_bench_runs_auto_as_one_method():
    methods = parse_methods("ngram,auto,auto:k=2", SpecConfig(), "suffix,eagle3,draft")
    auto = [m for m in methods if m.name.startswith("auto")]
    assert [m.spec.method for m in auto] == ["suffix,eagle3,draft"] * 2
    assert all(m.spec.combine == "best" for m in auto) and auto[1].spec.num_draft_tokens == 2
