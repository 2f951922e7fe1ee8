"""Training on several ranks: real gloo process groups on the CPU (distributed_runs.py; nothing of
torch.distributed mocked). Two ranks take the steps one process takes with the same global batch and seed, a
checkpoint written by two ranks resumes on one, FSDP shards a drafter and takes the same steps, feature
extraction splits its texts over the ranks with each computed once, and `train --nproc 2` runs the command under
torchrun.

The tolerance: after the same optimizer steps, every weight of the two-rank result within TOLERANCE of the
one-process result (absolute). The ranks differ from one process only in the order in which the sequences'
gradients are added (float32, at the parameters: per-sequence autocast, parallel.Objective); measured here
(2026-12-06) at most 6e-8 for EAGLE-3 under DDP and 1.2e-7 for DFlash under FSDP, after 3 steps of AdamW."""

from __future__ import annotations

import itertools
import shutil
from dataclasses import replace

import pytest
import torch
from conftest import save_tiny_model
from distributed_runs import one_thread, train, train_on_ranks
from safetensors.torch import load_file

from specdecode.cli.main import main
from specdecode.cli.train import training_texts
from specdecode.models.loader import load_model
from specdecode.training.eagle3 import feature_layer_ids
from specdecode.training.features import check_manifest, extract, load_shard, shard_files, shard_ordinal
from specdecode.training.loop import TrainSettings, data_order
from specdecode.training.ranks import Ranks

TOLERANCE = 1e-5
BUDGET = {("train", "code"): 1200, ("held_out", "code"): 200}
SETTINGS = TrainSettings(draft_vocab=48, intermediate_size=64, epochs=1, lr=3e-3, eval_every=2, batch=4,
                         modules=1, anchors=4, block_size=4)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tiny target's folder and features (13 training sequences: 3 steps of 4)."""
    root = tmp_path_factory.mktemp("distributed")
    folder = save_tiny_model(root / "target", "qwen2", scale=0.15)
    target = load_model(folder, dtype="float32")
    features = root / "features"
    layer_ids = feature_layer_ids(target.config.num_layers)
    check_manifest(features, {"layer_ids": list(layer_ids), "max_len": 96})
    extract(target, layer_ids, itertools.islice(training_texts(), 1200), features, BUDGET, 8, 96, quiet=True)
    return folder, features, root


@pytest.fixture(scope="module")
def eagle3_runs(prepared):
    """The same EAGLE-3 training on two gloo ranks (its step-2 checkpoint kept) and on one process."""
    folder, features, root = prepared
    train_on_ranks(2, "eagle3", folder, features, root / "two", SETTINGS, snapshot_at=2, snapshot=root / "at-2")
    with one_thread():
        one = train("eagle3", folder, features, root / "one", SETTINGS)
    return root, one


def weight_difference(first, second) -> float:
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys()
    return max(float((a[name].double() - b[name].double()).abs().max()) for name in a)


def test_two_ranks_take_the_steps_one_process_takes(eagle3_runs):
    root, one = eagle3_runs
    assert one["steps"] == 3 and one["batch"] == 4
    assert weight_difference(root / "one", root / "two") <= TOLERANCE
    two = torch.load(root / "two" / "checkpoint.pt", weights_only=True)
    assert two["step"] == 3 and two["measured"] == one["held_out_accuracy"]  # measured once, over both ranks
    assert list(two["measured"]) == ["code"] and len(shard_files(root / "features", "held_out")) >= 2


def test_a_checkpoint_of_two_ranks_resumes_on_one_process(prepared, eagle3_runs):
    folder, features, root = prepared
    resumed = root / "resumed"
    resumed.mkdir()
    shutil.copy(root / "at-2" / "checkpoint.pt", resumed / "checkpoint.pt")
    with one_thread():  # no batch given: the checkpoint's, 4
        result = train("eagle3", folder, features, resumed, replace(SETTINGS, batch=None))
    assert result["steps"] == 3 and result["batch"] == 4
    assert weight_difference(root / "one", resumed) <= TOLERANCE


def test_fsdp_shards_a_dflash_drafter_and_takes_the_same_steps(prepared):
    folder, features, root = prepared
    train_on_ranks(2, "dflash", folder, features, root / "fsdp", replace(SETTINGS, fsdp=True), snapshot_at=2,
                   snapshot=root / "fsdp-2")
    with one_thread():
        train("dflash", folder, features, root / "dflash-one", SETTINGS)
    assert weight_difference(root / "dflash-one", root / "fsdp") <= TOLERANCE
    resumed = root / "dflash-resumed"  # a sharded run's checkpoint holds the whole drafter
    resumed.mkdir()
    shutil.copy(root / "fsdp-2" / "checkpoint.pt", resumed / "checkpoint.pt")
    with one_thread():
        train("dflash", folder, features, resumed, SETTINGS)
    assert weight_difference(root / "dflash-one", resumed) <= TOLERANCE


def test_features_are_split_over_ranks_each_text_computed_once(prepared, tmp_path):
    folder, features, _ = prepared
    target = load_model(folder, dtype="float32")
    layer_ids = feature_layer_ids(target.config.num_layers)
    split = tmp_path / "split"
    check_manifest(split, {"layer_ids": list(layer_ids), "max_len": 96})
    done = [extract(target, layer_ids, itertools.islice(training_texts(), 1200), split, BUDGET, 8, 96, quiet=True,
                    ranks=Ranks(rank, 2)) for rank in (0, 1)]
    for key, tokens in BUDGET.items():  # the ranks' shares add up to the budget
        assert done[0][key] + done[1][key] >= tokens and min(done[0][key], done[1][key]) >= tokens // 2
    one_process = {path.relative_to(features): path for split_name in ("train", "held_out")
                   for path in shard_files(features, split_name)}
    for split_name in ("train", "held_out"):
        ordinals = [shard_ordinal(path) for path in shard_files(split, split_name)]
        assert len(ordinals) == len(set(ordinals))  # every text computed once (its ordinal names its one file)
        for path in shard_files(split, split_name):
            same = one_process.get(path.relative_to(split))
            if same is not None:  # the text one process also took: the very same features
                ours, theirs = load_shard(path), load_shard(same)
                assert all(torch.equal(a, b) for a, b in zip(vars(ours).values(), vars(theirs).values()))
    # A rerun on one process over the split folder owns every shard: nothing is computed again.
    again = extract(target, layer_ids, itertools.islice(training_texts(), 1200), split, BUDGET, 8, 96, quiet=True)
    assert again == {key: done[0][key] + done[1][key] for key in BUDGET}


def test_every_training_sequence_is_taken_once_an_epoch_whatever_the_ranks():
    files = [f"{i:06d}-code" for i in range(12)]
    order = data_order(files, epochs=2, seed=5)
    for world in (1, 2, 4):
        taken = [path for step in range(len(order) // 4)
                 for rank in range(world) for path in Ranks(rank, world).share(order[step * 4 : (step + 1) * 4])]
        assert sorted(taken[:12]) == files and sorted(taken[12:]) == files


def test_the_train_command_on_two_processes(prepared, tmp_path, capfd):
    folder, _, _ = prepared
    out = tmp_path / "out"
    args = ["train", "eagle3", "--target", str(folder), "--out", str(out), "--features", str(tmp_path / "features"),
            "--dtype", "float32", "--quant", "none", "--tokens", "400", "--held-out-tokens", "100", "--code-share",
            "1", "--answer-tokens", "8", "--max-len", "64", "--draft-vocab", "32", "--intermediate-size", "32",
            "--epochs", "1", "--eval-every", "2", "--quiet", "--nproc", "2", "--batch", "2"]
    assert main(args) == 0
    assert "2 ranks, batch 2" in capfd.readouterr().err
    assert (out / "model.safetensors").exists() and (out / "learning_curve.jsonl").exists()
    shards = shard_files(tmp_path / "features", "train")
    assert {shard_ordinal(path) % 2 for path in shards} == {0, 1}  # both ranks computed features
    assert main([*args[:-1], "3"]) == 2  # refused before any process starts
    assert capfd.readouterr().err.count("error:") == 1
    assert main([*args, "--draft-vocab", "16"]) == 2  # refused by every rank: said once, by rank 0
    err = capfd.readouterr().err
    assert err.count("error:") == 1 and "other settings (draft_vocab)" in err
