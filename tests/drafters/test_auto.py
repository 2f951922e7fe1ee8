"""auto, a registered combination: what it finds for a target, the line it prints, that every front door takes it,
and that its chain stays lossless."""

from __future__ import annotations

import pytest
from conftest import TINY_VOCAB, save_tiny_model
from eagle3_reference import head_config, random_head, write_head

from specdecode import Engine, SpecConfig, load_model
from specdecode.bench.suite import parse_methods
from specdecode.cli.main import main
from specdecode.drafters.auto import AutoDrafter, find_sources
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.models.formats.drafter_folder import trained_folder


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
    write_head(trained_folder("eagle3", str(target)), weights, head_config(weights, TINY_VOCAB, "reference", [2, 4, 5]),
               "reference")


def test_what_auto_finds(cache, tiny_target, monkeypatch):
    alone = find_sources(str(tiny_target), None, None)
    assert (alone.draft_model, alone.draft_paths) == (None, {})
    given = find_sources(str(tiny_target), "some-draft", None)
    assert given.draft_model == "some-draft" and "draft model some-draft given" in given.found
    write_trained_head(tiny_target)
    found = find_sources(str(tiny_target), None, None)
    assert found.draft_paths == {"eagle3": str(cache / "eagle3" / "tiny-target")}
    assert any(line.startswith("an EAGLE-3 head trained at") for line in found.found)
    assert find_sources(str(tiny_target), None, "/elsewhere").draft_paths == {"eagle3": "/elsewhere"}  # given wins
    # METHOD=PATH pairs: an MTP companion named for mtp joins, and the head found beside it is kept.
    paired = find_sources(str(tiny_target), None, "mtp=/x/mtp-m.gguf")
    assert paired.draft_paths == {"mtp": "/x/mtp-m.gguf", "eagle3": str(cache / "eagle3" / "tiny-target")}
    assert find_sources(str(tiny_target), None, "eagle3=/h").draft_paths == {"eagle3": "/h"}
    assert trained_folder("eagle3", None) == cache / "eagle3" / DEFAULT_TARGET
    assert trained_folder("eagle3", "/models/x-q4_k_m.gguf") == cache / "eagle3" / "x-q4_k_m"
    # The default target pairs with the default draft when its package is installed.
    monkeypatch.setattr("specdecode.models.pairing.installed_defaults", lambda: [DEFAULT_DRAFT])
    assert find_sources(None, None, None).draft_model == DEFAULT_DRAFT


def test_auto_runs_every_drafter_found_for_what_was_loaded(cache, tiny_target):
    """The members come from what the engine loaded, in auto_rank order, with per-step choice."""
    target = load_model(tiny_target, dtype="float32")
    assert Engine(target).check_spec(SpecConfig("auto")).method == "suffix"
    write_trained_head(tiny_target)
    paths = find_sources(str(tiny_target), None, None).draft_paths
    engine = Engine(target, load_model(tiny_target, dtype="float32"), draft_path=paths)
    spec = engine.check_spec(SpecConfig("auto", num_draft_tokens=2))
    assert (spec.method, spec.combine, spec.num_draft_tokens) == ("suffix,eagle3,draft", "best", 2)
    line = AutoDrafter.describe(engine.resources)
    assert line.startswith("auto: suffix,eagle3,draft with per-step choice")
    assert "eagle3: an EAGLE-3 head at" in line
    # Combined with a named method, its members join once.
    assert engine.check_spec(SpecConfig("recycle,auto")).method == "recycle,suffix,eagle3,draft"


def test_auto_generates_what_plain_decoding_does(cache, tiny_target, capsys):
    write_trained_head(tiny_target)
    args = ["generate", "abcabcabc", "--model", str(tiny_target), "--max-tokens", "12", "--ignore-eos",
            "--dtype", "float32", "--quant", "none", "--spec-type", "auto", "--compare-plain"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "auto: suffix,eagle3 with per-step choice" in err and "identical output: True" in err


def test_bench_runs_auto_as_one_method():
    methods = parse_methods("ngram,auto,auto:k=2", SpecConfig())
    auto = [m for m in methods if m.name.startswith("auto")]
    assert [m.spec.method for m in auto] == ["auto"] * 2 and auto[1].spec.num_draft_tokens == 2
