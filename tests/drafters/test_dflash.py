"""DFlash: our drafter against the authors' reference implementation (fixtures made by
tests/fixtures/dflash/make_fixtures.py with PyPI `dflash`), its loader's checks, and what it writes reading back.
The contract suite holds `dflash` to greedy identity and the target's distribution like every drafter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import FIXTURES_ROOT

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models.formats.dflash import load_dflash, save_dflash
from specdecode.models.loader import load_model

FIXTURES = FIXTURES_ROOT / "dflash"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


@pytest.fixture(scope="module")
def target():
    return load_model(FIXTURES / "target", dtype="float32")


def our_block_logits(target, drafter) -> torch.Tensor:
    """The first block after the prompt, as our drafter computes it -> logits [B-1, V]."""
    model, prompt = target.model, EXPECTED["prompt"]
    ids = drafter.config.boundary_ids
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], model.new_cache(len(prompt)),
                    hidden_layers=ids)
        states = torch.cat([out.hidden[i][0] for i in ids], dim=-1)  # [P, n_aux*H]
        cache = drafter.new_cache(64)
        drafter.add_context(states, torch.arange(len(prompt)), cache)
        block = torch.tensor([EXPECTED["first_token"]] + [drafter.config.mask_token_id] * (drafter.config.block_size - 1))
        logits = drafter.block_logits(block, torch.arange(len(prompt), len(prompt) + len(block)), cache)
    assert cache.lengths == [len(prompt)]  # the block's keys never stay
    return logits


def test_block_logits_match_the_reference_implementation(target):
    drafter, description = load_dflash(FIXTURES / "drafter", target.model, 128)
    assert "2 layers, block 4, target layers 0, 2" in description
    expected = torch.tensor(EXPECTED["block_logits"])  # [B-1, V] from dflash 0.1.0
    assert torch.allclose(our_block_logits(target, drafter), expected, atol=1e-4)  # float32: rounding only


def test_greedy_generation_is_the_reference_s_and_plain_decoding(target):
    engine = Engine(target, draft_path=FIXTURES / "drafter")
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    result = engine.complete(EXPECTED["prompt"], sampling, SpecConfig("dflash", guard=False), raw=True)
    assert result.token_ids == EXPECTED["generated"] == engine.complete(EXPECTED["prompt"], sampling,
                                                                         raw=True).token_ids
    # Blocks of 3 drafts (block size 4), not the adaptive length; only the token budget cuts the last ones.
    assert len(result.stats.drafted_per_position) == 3 and result.stats.drafting_steps > 3
    smaller = engine.complete(EXPECTED["prompt"], sampling,
                              SpecConfig("dflash", guard=False, options={"dflash_block_size": 3}), raw=True)
    assert smaller.token_ids == result.token_ids and len(smaller.stats.drafted_per_position) == 2


def test_what_we_write_reads_back_the_same(target, tmp_path):
    drafter, _ = load_dflash(FIXTURES / "drafter", target.model, 128)
    save_dflash(drafter, tmp_path / "copy", target.config)
    again, _ = load_dflash(tmp_path / "copy", target.model, 128)
    assert torch.equal(our_block_logits(target, again), our_block_logits(target, drafter))
    saved = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert saved["dflash_config"]["target_layer_ids"] == [0, 2] and saved["architectures"] == ["DFlashDraftModel"]


def test_a_drafter_for_another_target_is_one_clear_error(tmp_path, target):
    folder = tmp_path / "other"
    shutil.copytree(FIXTURES / "drafter", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_target_layers": 28}))
    with pytest.raises(SpecDecodeError, match="not trained for this target: it reads a 28-layer target"):
        load_dflash(folder, target.model, 128)
    (folder / "config.json").write_text(json.dumps(config | {"dflash_config": {"target_layer_ids": [0, 2]}}))
    with pytest.raises(SpecDecodeError, match="mask_token_id must be a token id"):
        load_dflash(folder, target.model, 128)
    with pytest.raises(SpecDecodeError, match="needs a DFlash drafter"):
        Engine(target).complete("hi", SamplingParams(max_tokens=2), SpecConfig("dflash"))


def test_inspect_finds_a_dflash_drafter_beside_the_model(tmp_path, capsys):
    from specdecode.cli.main import main

    shutil.copytree(FIXTURES / "target", tmp_path / "target")
    shutil.copytree(FIXTURES / "drafter", tmp_path / "target-dflash")
    assert main(["inspect", str(tmp_path / "target"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"kind": "dflash", "path": str(tmp_path / "target-dflash")} in report["drafters_beside"]
    row = next(m for m in report["methods"] if m["method"] == "dflash")
    assert row["usable"] and row["flags"] == f"--spec-type dflash --draft-head {tmp_path / 'target-dflash'}"
