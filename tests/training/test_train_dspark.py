"""Training a DSpark drafter: the objective's slots against drafting (every slot, the Markov correction and the
confidence), a tiny run in the shared loop that learns, resumes, and writes a drafter that stays lossless."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.main import main
from specdecode.cli.train import training_texts
from specdecode.models.heads.dspark import DSparkHeads
from specdecode.models.loader import load_model
from specdecode.training.data import code_texts
from specdecode.training.dflash import choose_anchors
from specdecode.training.dspark import dspark_objective, new_dspark, train_dspark
from specdecode.training.eagle3 import default_layer_ids, feature_columns, feature_layer_ids
from specdecode.training.features import Shard, check_manifest, extract
from specdecode.training.loop import CHECKPOINT, TrainSettings, expected_accepted


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_tiny_model(tmp_path_factory.mktemp("dspark-train") / "t", "qwen2", scale=0.15,
                                      num_hidden_layers=6), dtype="float32")


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_each_anchored_block_is_what_drafting_computes(target, kind):
    """Block a's corrected logits and confidences in the objective equal the drafter's after context 0..a-1,
    with the data's tokens as the drafts before each slot (teacher forcing)."""
    settings = TrainSettings(modules=2, intermediate_size=64, block_size=4)
    model = new_dspark(target, settings, DSparkHeads(markov_rank=8, markov_kind=kind))
    with torch.no_grad():  # away from the zero start, so the heads' terms are checked
        for name, param in model.named_parameters():
            if name.startswith(("markov_head.", "confidence_head.")):
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.3)
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
    objective = dspark_objective(model, feature_columns(layers, layers, 64), rows, anchors=5, keep_logits=True)
    with torch.no_grad():
        result = objective(shard, torch.arange(272))
    assert len(result.correct) == 4 and result.counted[0] == 5  # every slot drafts, slot 0 included
    for index, start in enumerate(choose_anchors(shard, 5, 4).tolist()):
        cache = model.new_cache(32)
        with torch.inference_mode():
            model.add_context(states[:start], torch.arange(start), cache)
            block = torch.tensor([int(tokens[start])] + [model.config.mask_token_id] * 3)
            hidden = model.block_hidden(block, torch.arange(start, start + 4), cache)  # [4, H]
            base, state = model.head_logits(hidden), model.start_state(1)
            for slot in range(min(4, 20 - start)):  # slots past the sequence's end are not computed
                previous = tokens[start + slot].view(1)
                logits, state = model.slot_logits(base[slot : slot + 1], hidden[slot : slot + 1], previous, state)
                assert torch.allclose(result.logits[0][index, slot], logits[0], atol=1e-4), (start, slot)
                confidence = model.confidence_logits(hidden[slot : slot + 1], previous)
                assert torch.allclose(result.logits[1][index, slot], confidence[0], atol=1e-4), (start, slot)


def test_a_tiny_drafter_learns_resumes_and_drafts_losslessly(target, tmp_path):
    layers = feature_layer_ids(target.config.num_layers)
    features = tmp_path / "features"
    check_manifest(features, {"layer_ids": list(layers), "max_len": 160})
    extract(target, layers, training_texts(), features, {("train", "code"): 3000, ("held_out", "code"): 600},
            answer_tokens=16, max_len=160, quiet=True)
    settings = TrainSettings(modules=1, intermediate_size=64, block_size=4, anchors=8, epochs=6, lr=3e-3,
                             eval_every=10, markov_rank=16, markov_kind="gated")
    curve = []
    result = train_dspark(target, features, tmp_path / "out", settings, quiet=True,
                          on_eval=lambda step, tokens, accuracy: curve.append(accuracy))
    assert len(result["held_out_accuracy"]["code"]) == 4  # one rate per slot: every slot drafts
    assert expected_accepted(curve[-1]["code"]) > expected_accepted(curve[0]["code"])  # it learns
    # Resuming a finished run trains nothing more and writes the same drafter.
    written = (tmp_path / "out" / "model.safetensors").read_bytes()
    again = train_dspark(target, features, tmp_path / "out", settings, quiet=True)
    assert again["steps"] == result["steps"] and (tmp_path / "out" / "model.safetensors").read_bytes() == written
    assert (tmp_path / "out" / CHECKPOINT).exists()
    engine = Engine(target, draft_path=tmp_path / "out")
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    accepted = 0
    for text in [t.text for t in itertools.islice(code_texts(), 4)]:  # code like what it learnt from
        drafted = engine.complete(text[:200], sampling, SpecConfig("dspark", guard=False), raw=True)
        assert drafted.token_ids == engine.complete(text[:200], sampling, raw=True).token_ids
        accepted += drafted.stats.accepted_tokens
    assert accepted > 0


def test_the_train_dspark_command(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    args = ["train", "dspark", "--target", str(folder), "--out", str(tmp_path / "out"), "--dtype", "float32",
            "--quant", "none", "--tokens", "600", "--held-out-tokens", "150", "--code-share", "1", "--answer-tokens",
            "8", "--max-len", "96", "--block-size", "4", "--num-layers", "1", "--intermediate-size", "32",
            "--markov-rank", "8", "--markov-head", "rnn", "--epochs", "1", "--eval-every", "4", "--quiet"]
    assert main(args) == 0
    assert f"--spec-type dspark --draft-model {tmp_path / 'out'}" in capsys.readouterr().err
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert main([*args[:-1], "--markov-rank", "-1"]) == 2
    assert "--markov-rank must be >= 0" in capsys.readouterr().err
