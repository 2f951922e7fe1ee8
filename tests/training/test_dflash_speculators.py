"""DFlash drafters in vLLM's speculators layout: the reference fixture's drafter rewritten the way
vllm-project/speculators' converter writes one (code of this test's own) must draft exactly as the z-lab
original; a reduced draft vocabulary (`d2t`) drafts over its tokens only; the attention rule and the errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_dflash import EXPECTED, FIXTURES, our_block_logits

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models.formats.dflash import load_dflash
from specdecode.models.loader import load_model


@pytest.fixture(scope="module")
def target():
    return load_model(FIXTURES / "target", dtype="float32")


def write_speculators(folder: Path, target, draft_ids: list[int] | None = None, **changes) -> Path:
    """The z-lab fixture drafter as speculators' converter writes it: the layer config nested, layer ids as
    indices into hidden_states (z-lab's + 1), the target's embedding and head copied in; with `draft_ids`, a
    reduced vocabulary (lm_head rows of those tokens, d2t offsets, t2d mask)."""
    zlab = json.loads((FIXTURES / "drafter" / "config.json").read_text())
    layer = {k: v for k, v in zlab.items() if k not in ("architectures", "block_size", "dflash_config",
                                                         "num_target_layers")}
    vocab = zlab["vocab_size"]
    config = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
              "transformer_layer_config": layer, "draft_vocab_size": len(draft_ids) if draft_ids else vocab,
              "block_size": zlab["block_size"], "target_hidden_size": None,
              "aux_hidden_state_layer_ids": [i + 1 for i in zlab["dflash_config"]["target_layer_ids"]],
              "mask_token_id": zlab["dflash_config"]["mask_token_id"], "sliding_window_non_causal": False,
              "sample_from_anchor": False,
              "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy",
                                                           "speculative_tokens": zlab["block_size"] - 1}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["Qwen3ForCausalLM"]}}}
    config.update(changes)
    head = target.model.output_rows(torch.arange(zlab["vocab_size"]))  # [V, H], whatever the head's storage
    tensors = load_file(FIXTURES / "drafter" / "model.safetensors")
    tensors["embed_tokens.weight"] = target.model.embed.weight.detach().clone()
    if draft_ids:
        ids = torch.tensor(draft_ids)
        tensors["lm_head.weight"] = head[ids].contiguous()
        tensors["d2t"] = ids - torch.arange(len(ids))
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    else:
        tensors["lm_head.weight"] = head
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_speculators_drafter_drafts_as_the_z_lab_original(target, tmp_path):
    original, _ = load_dflash(FIXTURES / "drafter", target.model, 128)
    drafter, description = load_dflash(write_speculators(tmp_path / "spec", target), target.model, 128)
    assert "speculators layout, 2 layers, block 4, target layers 0, 2" in description
    assert drafter.config.boundary_ids == original.config.boundary_ids == (1, 3)
    logits = our_block_logits(target, drafter)
    assert torch.equal(logits, our_block_logits(target, original))
    assert torch.allclose(logits, torch.tensor(EXPECTED["block_logits"]), atol=1e-4)  # the authors' own code


def test_a_reduced_draft_vocabulary_drafts_its_tokens_only_and_stays_lossless(target, tmp_path):
    full = our_block_logits(target, load_dflash(FIXTURES / "drafter", target.model, 128)[0])  # [B-1, V]
    draft_ids = sorted(set(range(0, 272, 3)) | set(full.argmax(dim=-1).tolist()) | set(EXPECTED["generated"]))
    folder = write_speculators(tmp_path / "reduced", target, draft_ids)
    drafter, description = load_dflash(folder, target.model, 128)
    assert f"a {len(draft_ids)}-token draft vocabulary" in description
    reduced = our_block_logits(target, drafter)
    assert torch.allclose(reduced[:, draft_ids], full[:, draft_ids], atol=1e-5)
    others = torch.ones(272, dtype=torch.bool).index_fill_(0, torch.tensor(draft_ids), False)
    assert torch.isneginf(reduced[:, others]).all()
    engine = Engine(target, draft_path=folder)
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    result = engine.complete(EXPECTED["prompt"], sampling, SpecConfig("dflash", guard=False), raw=True)
    assert result.token_ids == EXPECTED["generated"] and result.stats.drafted_tokens > 0


def test_sliding_layers_follow_speculators_attention_rule(target, tmp_path):
    zlab = json.loads((FIXTURES / "drafter" / "config.json").read_text())
    layer = {k: v for k, v in zlab.items() if k not in ("architectures", "block_size", "dflash_config",
                                                         "num_target_layers")}
    windowed = layer | {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 2048}
    causal = load_dflash(write_speculators(tmp_path / "a", target, transformer_layer_config=windowed),
                         target.model, 128)[0].config
    assert causal.causal_layers == (True, False) and causal.windows == (2048, None)
    both_ways = load_dflash(write_speculators(tmp_path / "b", target, transformer_layer_config=windowed,
                                              sliding_window_non_causal=True), target.model, 128)[0].config
    assert both_ways.causal_layers == (False, False)


@pytest.mark.parametrize(("changes", "message"), [
    ({"sample_from_anchor": True}, "sample_from_anchor .* is not read for a DFlash drafter"),
    ({"speculators_model_type": "eagle3"}, "a speculators EAGLE-3 head, not a block drafter: use --spec-type eagle3"),
    ({"speculators_model_type": "mtp"}, "reads EAGLE-3, DFlash and DSpark"),
    ({"aux_hidden_state_layer_ids": [1, 9]}, "not trained for this target: target layers \\[0, 8\\]"),
    ({"transformer_layer_config": None}, "needs transformer_layer_config"),
])
def test_errors_name_what_is_wrong(target, tmp_path, changes, message):
    with pytest.raises(SpecDecodeError, match=message):
        load_dflash(write_speculators(tmp_path / "bad", target, **changes), target.model, 128)


def test_a_draft_vocabulary_for_another_target_is_one_error(target, tmp_path):
    folder = write_speculators(tmp_path / "other", target, [0, 1, 2])
    tensors = load_file(folder / "model.safetensors")
    save_file(tensors | {"d2t": torch.tensor([0, 400, 0])}, str(folder / "model.safetensors"))
    with pytest.raises(SpecDecodeError, match="outside the target's 272 .* made for another target"):
        load_dflash(folder, target.model, 128)
    shutil.rmtree(folder)
    folder = write_speculators(tmp_path / "other", target, [0, 1, 2])
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(folder / "model.safetensors"))
    with pytest.raises(SpecDecodeError, match="d2t maps 3 draft tokens but lm_head is missing"):
        load_dflash(folder, target.model, 128)
