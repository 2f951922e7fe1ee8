"""Training an EAGLE-3 head: offline data, the training-time test against inference, features on disk, a tiny
run that learns, resuming, and a head that loads and drafts losslessly."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from conftest import save_tiny_model
from eagle3_reference import head_config, random_head, write_head

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.main import main
from specdecode.cli.train import training_texts
from specdecode.models.formats.eagle3 import load_eagle3_head
from specdecode.models.loader import load_model
from specdecode.training.data import code_texts, is_held_out, prompts
from specdecode.training.eagle3 import Eagle3Unroll, default_layer_ids, train_eagle3
from specdecode.training.features import check_manifest, extract
from specdecode.training.loop import TrainSettings, expected_accepted
from specdecode.training.ttt import step_mask, unroll

LIBRARY = '''
def mean(values):
    """Return the arithmetic mean of a non-empty sequence of numbers, as a float."""
    return sum(values) / len(values)


def _private(x):
    """A private helper that is long enough to be documented but must not become a prompt."""
    return x


def clamp(value, low, high):
    """Clamp value into the closed interval [low, high] and return the result."""
    return max(low, min(high, value))
'''


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_tiny_model(tmp_path_factory.mktemp("train") / "t", "qwen2", scale=0.15), dtype="float32")


def test_offline_data_is_built_from_the_standard_library(tmp_path):
    (tmp_path / "stats_lite.py").write_text(LIBRARY * 8)
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_x.py").write_text(LIBRARY)
    tasks = list(prompts(tmp_path))
    assert [t.module for t in tasks] == ["stats_lite"] * 16 and all(t.is_prompt for t in tasks)
    assert "mean(values)" in tasks[0].text and "arithmetic mean" in tasks[0].text
    pieces = list(code_texts(tmp_path, chars=400))
    assert "".join(p.text for p in pieces) == LIBRARY * 8 and not any(p.is_prompt for p in pieces)
    assert is_held_out("stats_lite") == pieces[0].held_out  # a fixed split by module name
    real = list(prompts())
    assert len(real) > 500 and 0 < sum(t.held_out for t in real) < len(real) // 5


def test_the_training_time_test_computes_what_inference_drafts(target, tmp_path):
    """Step k's logits at row j equal the head's k-th draft after committed rows 0..j-k, fed the same tokens."""
    weights = random_head(64, 272, scale=0.3)
    head, _ = load_eagle3_head(write_head(tmp_path / "h", weights, head_config(weights, 272, "reference"),
                                          "reference"), target.model, 64)
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (12,))
    features = torch.randn(12, 3 * 64)
    top_ids = torch.randint(0, 272, (12, 4))
    layer = Eagle3Unroll(head, torch.arange(3 * 64))
    result = unroll(layer, tokens, features, top_ids, torch.full((12, 4), -1.0), torch.ones(12, dtype=torch.bool),
                    torch.arange(272), steps=3, keep_logits=True)
    fused = head.fuse(list(features.split(64, dim=-1)))
    for step in range(3):
        for row in range(step, 11):
            cache = head.new_cache(16)
            committed = row - step + 1  # rows 0..row-step
            ids = tokens[1 : committed + 1].view(1, -1)
            logits, hidden = head(ids, fused[:committed].unsqueeze(0), torch.arange(committed).view(1, -1), cache)
            for m in range(1, step + 1):
                position = committed - 1 + m
                logits, hidden = head(tokens[position + 1].view(1, 1), hidden[:, -1:],
                                      torch.tensor([[position]]), cache)
            assert torch.allclose(result.logits[step][row], logits[0, -1], rtol=1e-4, atol=1e-3), (step, row)
    # A next token outside the draft vocabulary is learnt from by no row but counts as a miss in acceptance.
    half = torch.where(torch.arange(272) < 136, torch.arange(272), -1)
    narrow = unroll(layer, tokens, features, top_ids, torch.full((12, 4), -1.0), torch.ones(12, dtype=torch.bool),
                    half, steps=3)
    assert narrow.counted == [11, 10, 9] == result.counted
    assert all(c <= int((top_ids[1 + s :, 0] < 136).sum()) for c, s in zip(narrow.correct, range(3)))
    assert step_mask(3, 1, torch.device("cpu")).tolist() == [
        [False, False, False, True, False, False], [True, False, False, False, True, False],
        [True, True, False, False, False, True]]


def test_a_tiny_head_learns_resumes_and_drafts_losslessly(target, tmp_path):
    texts = list(itertools.islice(training_texts(), 1200))
    features = tmp_path / "features"
    layer_ids = default_layer_ids(target.config.num_layers)
    check_manifest(features, {"layer_ids": list(layer_ids), "max_len": 256})
    budget = {("train", "code"): 2400, ("train", "answer"): 600, ("held_out", "code"): 400,
              ("held_out", "answer"): 200}
    done = extract(target, layer_ids, iter(texts), features, budget, answer_tokens=16, max_len=256, quiet=True)
    assert all(done[key] >= tokens for key, tokens in budget.items()), done
    names = [path.name for path in sorted((features / "held_out").iterdir())]
    assert {name.split("-")[1] for name in names} == {"answer.safetensors", "code.safetensors"}
    assert extract(target, layer_ids, iter(texts), features, budget, 16, 256, quiet=True) == done  # nothing redone
    settings = TrainSettings(draft_vocab=48, intermediate_size=64, epochs=6, lr=3e-3, eval_every=10)
    curve = []
    first = train_eagle3(target, features, tmp_path / "head", settings, quiet=True,
                         on_eval=lambda step, tokens, accuracy: curve.append((step, accuracy)))
    assert curve[0][0] == 0 and len(curve) >= 3
    assert set(curve[0][1]) == {"answer", "code"}  # held-out acceptance on each kind of text
    assert expected_accepted(curve[-1][1]["code"]) > expected_accepted(curve[0][1]["code"])  # it learns
    assert target.model.embed.weight.grad is None  # the target's embedding is shared and frozen
    # Interrupted after its second measurement, then run again: it resumes and ends where an unbroken run ends.
    interrupted = tmp_path / "again"

    def stop_at_20(step, tokens, accuracy):
        if step == 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_eagle3(target, features, interrupted, settings, quiet=True, on_eval=stop_at_20)
    resumed = train_eagle3(target, features, interrupted, settings, quiet=True)
    assert resumed["steps"] == first["steps"]
    assert resumed["held_out_accuracy"] == first["held_out_accuracy"]  # deterministic: the same sequences, in order
    head, description = load_eagle3_head(tmp_path / "head", target.model, 512)
    assert "reference, layer ids from its config" in description and head.config.layer_ids == layer_ids
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["eagle_aux_hidden_state_layer_ids"] == list(layer_ids) and saved["draft_vocab_size"] == 48
    engine = Engine(target, draft_path=tmp_path / "head")
    for prompt in ("def mean(values):", "import os\nimport sys\n"):
        plain = engine.complete(prompt, SamplingParams(max_tokens=24, ignore_eos=True), SpecConfig("none"))
        drafted = engine.complete(prompt, SamplingParams(max_tokens=24, ignore_eos=True),
                                  SpecConfig("eagle3", guard=False))
        assert drafted.token_ids == plain.token_ids and drafted.stats.accepted_tokens > 0


def test_the_train_command(tmp_path, capsys):
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    out = tmp_path / "out"
    args = ["train", "eagle3", "--target", str(folder), "--out", str(out), "--dtype", "float32", "--quant", "none",
            "--tokens", "800", "--held-out-tokens", "200", "--code-share", "1", "--answer-tokens", "8",
            "--max-len", "128", "--draft-vocab", "32", "--intermediate-size", "32", "--epochs", "1",
            "--eval-every", "4", "--quiet"]
    assert main(args) == 0
    assert "--spec-type eagle3 --draft-model" in capsys.readouterr().err
    assert (out / "model.safetensors").exists() and (out / "learning_curve.jsonl").exists()
    assert main([*args, "--draft-vocab", "16"]) == 2  # other settings, same folder
    assert "other settings (draft_vocab)" in capsys.readouterr().err
    assert main([*args, "--tokens", "1200"]) == 2  # more features: resuming would skip or repeat sequences
    assert "other settings (shards)" in capsys.readouterr().err
    assert main([*args, "--tokens", "0"]) == 2
