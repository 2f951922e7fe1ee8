"""Hidden states vLLM wrote in speculators' offline layout (fixtures written by
tests/fixtures/vllm_hidden_states/make_fixtures.py): read as written (the layer stack, fp8 with scales, the Arrow
dataset's loss masks, locked and mismatched samples), converted into the very training inputs our own features
of the same text give, training the same head, and through `specdecode train --vllm-hidden-states`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES_ROOT
from safetensors.torch import load_file

from specdecode.cli.main import main
from specdecode.models.formats.eagle3 import published_tensors
from specdecode.models.loader import load_model
from specdecode.training.eagle3 import aux_layer_ids, new_head, train_eagle3
from specdecode.training.from_target import draft_vocabulary
from specdecode.training.features import check_manifest, load_shard, shard_files, write_shard
from specdecode.training.loop import TrainSettings

pytest.importorskip("pyarrow", reason="speculators' loss masks are read with pyarrow (the vllm extra)")
from specdecode.training.vllm_features import (  # noqa: E402  (after the skip: the module itself needs no pyarrow)
    convert,
    our_loss_mask,
    read_dataset_rows,
    read_sample,
    sample_files,
)

FIXTURES = FIXTURES_ROOT
PREPARED = FIXTURES / "vllm_hidden_states" / "prepared"
TARGET = FIXTURES / "dflash" / "target"
LAYER_IDS = (2, 3, 4)
PROMPT_LENGTHS = [len(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n".encode())
                  for prompt in ("What is a list?", "Name a prime.", "def f(x):")]
# The two heads' weights apart, as a share of how far training moved them (norms over every weight): AdamW's
# steps are near lr whatever a gradient's size, so where a gradient is near zero the inputs' rounding can turn its
# sign; measured 1.1% after 6 steps at lr 1e-3 (2026-12-06).
UPDATE_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET, dtype="float32", quant="none", quiet=True)


def test_the_files_read_as_vllm_and_speculators_write_them():
    files = sample_files(PREPARED / "hidden_states")
    assert list(files) == [0, 1, 2, 3, 4]  # hs_5 is still being written (a .lock beside it)
    rows = read_dataset_rows(PREPARED)
    assert len(rows) == 6
    first = read_sample(files[0], captured=3)
    assert first.hidden.shape == (len(rows[0][0]), 3, 32) and first.tokens.tolist() == rows[0][0]
    fp8 = read_sample(files[3], captured=3)  # row 0 in hs-connectors' fp8 form, dequantized
    scale = first.hidden.abs().amax(dim=(1, 2), keepdim=True)  # [T, 1, 1]
    assert ((fp8.hidden - first.hidden).abs() <= scale / 16).all()  # e4m3: 3 mantissa bits
    assert not torch.equal(fp8.hidden, first.hidden)
    mask = rows[0][1]
    assert our_loss_mask(mask).tolist() == mask[1:] + mask[-1:]  # ours at t: token t+1 is the assistant's


def test_vllm_hidden_states_give_the_training_inputs_our_own_features_give(target, tmp_path):
    """The same text through both sources: the converted shards are our extractor's, up to the rounding of two
    implementations of the target (transformers wrote the fixtures' states, our runtime computes ours), and a
    head trained on either is the same within UPDATE_TOLERANCE."""
    converted = tmp_path / "from-vllm"
    check_manifest(converted, {"layer_ids": list(LAYER_IDS), "max_len": 128})
    tokens, skipped = convert(target, PREPARED / "hidden_states", PREPARED, 3, converted)
    assert skipped == 1  # row 4: its token ids differ from the dataset's
    ours = tmp_path / "ours"
    check_manifest(ours, {"layer_ids": list(LAYER_IDS), "max_len": 128})
    rows = read_dataset_rows(PREPARED)
    shards = shard_files(converted, "train") + shard_files(converted, "held_out")
    assert sorted(int(path.stem.split("-")[0]) for path in shards) == [0, 1, 2, 3]
    for path in shards:
        index = int(path.stem.split("-")[0])
        if index == 3:
            continue  # row 0 again, in fp8: another rounding of the same states
        mine = ours / path.parent.name / path.name
        mine.parent.mkdir(parents=True, exist_ok=True)
        write_shard(target.model, mine, rows[index][0], PROMPT_LENGTHS[index] - 1, LAYER_IDS)
        theirs, same = load_shard(path), load_shard(mine)
        assert torch.equal(theirs.tokens, same.tokens) and torch.equal(theirs.loss_mask, same.loss_mask)
        assert torch.equal(theirs.top_ids[:, :8], same.top_ids[:, :8])  # the likeliest, no near ties among them
        assert torch.allclose(theirs.top_logprobs, same.top_logprobs, atol=1e-4)
        # One bf16 step at each value, and float32's difference of the two implementations where states
        # nearly cancel to zero (measured: 5e-7).
        step = same.hidden.float().abs() * 2**-7 + 1e-5
        assert ((theirs.hidden.float() - same.hidden.float()).abs() <= step).all()
    for split in ("train", "held_out"):  # row 0 in fp8 has no counterpart among ours
        (converted / split / "000003-vllm.safetensors").unlink(missing_ok=True)
    settings = TrainSettings(draft_vocab=64, intermediate_size=32, epochs=2, lr=1e-3, eval_every=4, batch=1)
    train_eagle3(target, converted, tmp_path / "head-vllm", settings, quiet=True)
    train_eagle3(target, ours, tmp_path / "head-ours", settings, quiet=True)
    a = load_file(str(tmp_path / "head-vllm" / "model.safetensors"))
    b = load_file(str(tmp_path / "head-ours" / "model.safetensors"))
    draft_ids = draft_vocabulary(shard_files(ours, "train"), 64, 272)
    start = published_tensors(new_head(target, LAYER_IDS, draft_ids, settings), "midlayer.")  # both runs' start
    weights = [name for name in a if a[name].is_floating_point()]
    apart = torch.cat([(a[name] - b[name]).flatten() for name in weights]).norm()
    moved = torch.cat([(b[name] - start[name]).flatten() for name in weights]).norm()
    assert apart <= UPDATE_TOLERANCE * moved


def test_the_train_command_on_vllm_hidden_states(tmp_path, capsys):
    out, features = tmp_path / "out", tmp_path / "features"
    args = ["train", "eagle3", "--target", str(TARGET), "--vllm-hidden-states", str(PREPARED / "hidden_states"),
            "--out", str(out), "--features", str(features), "--dtype", "float32", "--quant", "none",
            "--draft-vocab", "32", "--intermediate-size", "32", "--epochs", "1", "--quiet", "--speculators-layout"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "1 samples' token ids differ" in err and "--spec-type eagle3" in err
    manifest = json.loads((features / "manifest.json").read_text())
    assert manifest["source"] == "vllm" and manifest["layer_ids"] == list(LAYER_IDS)
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    assert main([*args, "--vllm-layer-ids", "2,3"]) == 2  # the last layer must be captured
    assert "the last one must be the target's last layer, 4" in capsys.readouterr().err
    assert main([*args, "--vllm-layer-ids", "3,4", "--features", str(tmp_path / "other")]) == 2
    assert "holds 3 layers, --vllm-layer-ids names 2" in capsys.readouterr().err


def test_a_head_reads_the_layers_vllm_captured():
    """EAGLE-3's own boundaries where the features keep them (speculators' default capture: 2, L//2, L-3 and L),
    else every captured one but the last layer."""
    assert aux_layer_ids((2, 14, 25, 28), 28) == (2, 14, 25)
    assert aux_layer_ids((1, 10, 20, 28), 28) == (1, 10, 20)
