"""Our exports in vLLM's speculators layout against speculators' own classes (PyPI speculators 0.9.0, run as an
oracle by tests/fixtures/speculators_oracle/make_fixtures.py in an environment of its own): each export loads with
`SpeculatorModel.from_pretrained` there, and its draft logits on the committed inputs equal ours; the exporters
still write exactly the committed files; and a head speculators wrote itself (a Qwen3-typed layer, RoPE only
under `rope_parameters`) reads here with its logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES_ROOT
from safetensors.torch import load_file

from specdecode.models.families import config_to_hf
from specdecode.models.formats.dflash import load_dflash
from specdecode.models.formats.dspark import load_dspark
from specdecode.models.formats.eagle3 import load_eagle3_head
from specdecode.models.formats.speculators_export import Verifier, save_block_speculators, save_eagle3_speculators
from specdecode.models.loader import load_model
from specdecode.training.dflash import block_objective
from specdecode.training.dspark import dspark_objective
from specdecode.training.features import Shard

FIXTURES = FIXTURES_ROOT / "speculators_oracle"
TARGET = FIXTURES_ROOT / "dflash" / "target"
VERIFIER_NAME = "tests/fixtures/dflash/target"
INPUTS = load_file(str(FIXTURES / "inputs.safetensors"))
ORACLE = load_file(str(FIXTURES / "oracle.safetensors"))
BLOCK = 4


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET, dtype="float32", quant="none", quiet=True)


def eagle3_logits(head) -> torch.Tensor:
    """Row i reads the features of token i and the embedding of token i+1, positions 0..T-2 -> [T-1, Vd]."""
    tokens, features = INPUTS["tokens"], INPUTS["features"]
    rows = tokens.numel() - 1
    with torch.inference_mode():
        fused = head.fuse(list(features[:rows].split(head.config.target_hidden_size, dim=-1)))  # [T-1, H]
        logits, _ = head(tokens[1:].view(1, -1), fused.unsqueeze(0), torch.arange(rows).view(1, -1),
                         head.new_cache(rows))
    return logits[0]


def anchored_shard() -> Shard:
    """The inputs as a training sequence whose only anchor candidates are the oracle's anchors (so the
    objective's choice of anchors is theirs)."""
    tokens = INPUTS["tokens"]
    loss_mask = torch.zeros(tokens.numel(), dtype=torch.bool)  # [T]
    loss_mask[INPUTS["anchors"]] = True
    zeros = torch.zeros(tokens.numel(), 1)  # [T, 1]: soft labels, unused by the logits compared
    return Shard(tokens, INPUTS["features"], zeros.long(), zeros, loss_mask)


def test_speculators_loads_our_eagle3_export_and_drafts_our_logits(target):
    head, description = load_eagle3_head(FIXTURES / "eagle3", target.model, 64)
    assert "speculators" in description and head.draft_to_target.tolist() == list(range(0, 272, 2))
    assert torch.allclose(eagle3_logits(head), ORACLE["eagle3_logits"], atol=1e-5)


def test_speculators_loads_our_dflash_and_dspark_exports_and_drafts_our_logits(target):
    rows = target.model.output_rows(torch.arange(272))  # [V, H]
    anchors = len(INPUTS["anchors"])
    dflash, _ = load_dflash(FIXTURES / "dflash", target.model, 64)
    with torch.no_grad():
        ours = block_objective(dflash, torch.arange(96), rows, anchors, keep_logits=True)(
            anchored_shard(), torch.arange(272))
    theirs = ORACLE["dflash_logits"].view(anchors, BLOCK, -1)  # every slot; DFlash drafts slots 1..B-1
    assert torch.allclose(ours.logits[0], theirs[:, 1:], atol=1e-5)
    dspark, _ = load_dspark(FIXTURES / "dspark", target.model, 64)
    with torch.no_grad():
        logits, confidence = dspark_objective(dspark, torch.arange(96), rows, anchors, keep_logits=True)(
            anchored_shard(), torch.arange(272)).logits
    assert torch.allclose(logits, ORACLE["dspark_logits"].view(anchors, BLOCK, -1), atol=1e-5)
    assert torch.allclose(confidence, ORACLE["dspark_confidence"].view(anchors, BLOCK), atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "dspark"])
def test_the_exporters_still_write_the_files_speculators_read(target, tmp_path, kind):
    """Read back and written again, each export is the committed one, config and tensors: the oracle's verdict
    holds for what the exporters write today."""
    folder = FIXTURES / kind
    verifier = Verifier(VERIFIER_NAME, config_to_hf(target.config)["architectures"])
    if kind == "eagle3":
        save_eagle3_speculators(load_eagle3_head(folder, target.model, 64)[0], tmp_path, verifier)
    else:
        load = load_dflash if kind == "dflash" else load_dspark
        save_block_speculators(load(folder, target.model, 64)[0], tmp_path, verifier)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((folder / "config.json").read_text())
    written, committed = load_file(str(tmp_path / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert written.keys() == committed.keys()
    assert all(torch.equal(written[name], committed[name]) for name in written)


def test_a_qwen3_head_speculators_wrote_reads_with_its_rope_and_qk_norms(target):
    head, _ = load_eagle3_head(FIXTURES / "eagle3_by_speculators", target.model, 64)
    layer = head.config.layer
    assert layer.rope_theta == 5e5 and layer.qk_norm and head.config.norm_before_residual
    assert torch.allclose(eagle3_logits(head), ORACLE["eagle3_by_speculators_logits"], atol=1e-5)
