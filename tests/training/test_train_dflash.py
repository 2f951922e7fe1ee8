"""Training a DFlash drafter: the anchored-block objective against drafting, a tiny run in the shared loop that
learns, and what it writes loading as a drafter that stays lossless."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from conftest import save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.main import main
from specdecode.cli.train import training_texts
from specdecode.models.loader import load_model
from specdecode.training.data import code_texts
from specdecode.training.dflash import block_objective, chained_hits, choose_anchors, new_dflash, train_dflash
from specdecode.training.eagle3 import default_layer_ids, feature_columns, feature_layer_ids
from specdecode.training.features import Shard, check_manifest, extract
from specdecode.training.loop import TrainSettings, expected_accepted


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_tiny_model(tmp_path_factory.mktemp("dflash") / "t", "qwen2", scale=0.15,
                                      num_hidden_layers=6), dtype="float32")


def test_each_anchored_block_is_what_drafting_computes(target):
    """Block a's logits in the objective equal the drafter's block after committed context 0..a-1."""
    settings = TrainSettings(modules=2, intermediate_size=64)
    model = new_dflash(target, settings, block_size=4)
    model.finish_loading(64)
    layers = default_layer_ids(target.config.num_layers)
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (20,))
    with torch.inference_mode():
        out = target.model(tokens.view(1, -1), torch.arange(20).view(1, -1), target.model.new_cache(20),
                           hidden_layers=layers)
    states = torch.cat([out.hidden[i][0] for i in layers], dim=-1)  # [T, 3H]
    shard = Shard(tokens, states, torch.randint(0, 272, (20, 4)), torch.full((20, 4), -1.0),
                  torch.ones(20, dtype=torch.bool))
    rows = target.model.output_rows(torch.arange(272))
    objective = block_objective(model, feature_columns(layers, layers, 64), rows, anchors=5, keep_logits=True)
    with torch.no_grad():
        result = objective(shard, torch.arange(272))
    starts = choose_anchors(shard, 5, 4).tolist()
    assert len(starts) == 5 and result.counted[0] == 5
    for index, start in enumerate(starts):
        cache = model.new_cache(32)
        with torch.inference_mode():
            model.add_context(states[:start], torch.arange(start), cache)
            block = torch.tensor([int(tokens[start])] + [model.config.mask_token_id] * 3)
            expected = model.block_logits(block, torch.arange(start, start + 4), cache)  # [3, V]
        width = min(3, 20 - start - 1)  # slots past the sequence's end are not computed against anything
        assert torch.allclose(result.logits[0][index][:width], expected[:width], atol=1e-4), start


def test_a_tiny_drafter_learns_and_drafts_losslessly(target, tmp_path):
    layers = feature_layer_ids(target.config.num_layers)
    features = tmp_path / "features"
    check_manifest(features, {"layer_ids": list(layers), "max_len": 160})
    extract(target, layers, training_texts(), features, {("train", "code"): 3000, ("held_out", "code"): 600},
            answer_tokens=16, max_len=160, quiet=True)
    settings = TrainSettings(modules=1, intermediate_size=64, block_size=4, anchors=8, epochs=6, lr=3e-3,
                             eval_every=10)
    curve = []
    result = train_dflash(target, features, tmp_path / "out", settings, quiet=True,
                          on_eval=lambda step, tokens, accuracy: curve.append(accuracy))
    assert len(result["held_out_accuracy"]["code"]) == 3  # one rate per drafting slot
    assert expected_accepted(curve[-1]["code"]) > expected_accepted(curve[0]["code"])  # it learns
    engine = Engine(target, draft_path=tmp_path / "out")
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    accepted = 0
    for text in [t.text for t in itertools.islice(code_texts(), 4)]:  # code like what it learnt from
        drafted = engine.complete(text[:200], sampling, SpecConfig("dflash", guard=False), raw=True)
        assert drafted.token_ids == engine.complete(text[:200], sampling, raw=True).token_ids
        accepted += drafted.stats.accepted_tokens
    assert accepted > 0


def test_the_train_dflash_command(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    args = ["train", "dflash", "--target", str(folder), "--out", str(tmp_path / "out"), "--dtype", "float32",
            "--quant", "none", "--tokens", "600", "--held-out-tokens", "150", "--code-share", "1", "--answer-tokens",
            "8", "--max-len", "96", "--block-size", "4", "--num-layers", "1", "--intermediate-size", "32",
            "--epochs", "1", "--eval-every", "4", "--quiet"]
    assert main(args) == 0
    assert f"--spec-type dflash --draft-model {tmp_path / 'out'}" in capsys.readouterr().err
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert main([*args[:-1], "--block-size", "1"]) == 2
    assert "--block-size must be 2..33" in capsys.readouterr().err


def test_held_out_rates_are_each_slots_acceptance_given_the_slots_before_it_right():
    """As the loop reads them (expected_accepted multiplies the rates) and as EAGLE-3's and MTP's are."""
    top_ids = torch.tensor([[5], [6], [7], [8]])  # [T, K]: the target's token at each position
    label_at = torch.tensor([[0, 1, 2], [0, 1, 2], [1, 2, 3]])  # [A, S]: the position each slot drafts
    drafts = torch.tensor([[5, 6, 0], [5, 0, 7], [0, 7, 8]])  # right: TTF, TFT, FTT
    accepted, reached = chained_hits(drafts, SimpleNamespace(top_ids=top_ids), label_at,
                                     torch.ones(3, 3, dtype=torch.bool))
    assert accepted == [2, 1, 0]  # a slot right after a miss is never accepted
    assert reached == [3, 2, 1]  # slot 2 is reached only where slots 0 and 1 were right
