"""Training MTP layers onto a model that has none: the training-time test against inference, a tiny run that
learns and resumes in the shared loop, and what it writes (a model folder in MiMo naming, a GGUF file with nextn
tensors) loading and drafting losslessly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import save_tiny_model
from gguf_files import write_gguf
from mtp_reference import add_mtp_layers

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.main import main
from specdecode.cli.train import training_texts
from specdecode.models.loader import load_model
from specdecode.models.model_files import load_companion
from specdecode.training.eagle3 import feature_layer_ids
from specdecode.training.features import check_manifest, extract
from specdecode.training.loop import TrainSettings, expected_accepted
from specdecode.training.mtp import MTPUnroll, mtp_vocabulary, train_mtp
from specdecode.training.ttt import unroll


def test_the_training_time_test_computes_what_the_mtp_drafter_drafts(tmp_path):
    """Step k's logits at row j equal the k-th draft after committed rows 0..j-k: module 0 over the committed
    rows, then module min(m, 1) one position on per step, fed its own output (two modules: the second sees only
    its own rows of the draft)."""
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    add_mtp_layers(folder, "mimo", modules=2, follow=0.5)
    target = load_model(folder, dtype="float32")
    model, layers = target.model, target.config.num_layers
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (12,))
    with torch.inference_mode():
        trunk = model(tokens.view(1, -1), torch.arange(12).view(1, -1), model.new_cache(12), hidden_layers=(layers,),
                      final_hidden=True)
    everything = torch.arange(target.config.vocab_size)
    layer = MTPUnroll(target, model.mtp, torch.arange(64), model.output_rows(everything), 64)
    result = unroll(layer, tokens, trunk.hidden[layers][0], torch.randint(0, 272, (12, 4)),
                    torch.full((12, 4), -1.0), torch.ones(12, dtype=torch.bool), everything, steps=3,
                    keep_logits=True)
    final = trunk.final_hidden[0]  # [T, H]
    for step in range(3):
        for row in range(step, 11):
            committed = row - step + 1  # rows 0..row-step
            caches = [model.new_mtp_cache(16), model.new_mtp_cache(16)]
            with torch.inference_mode():
                logits, hidden = model.mtp_forward(0, tokens[1 : committed + 1].view(1, -1),
                                                   final[:committed].unsqueeze(0),
                                                   torch.arange(committed).view(1, -1), caches[0])
                for m in range(1, step + 1):
                    position = committed - 1 + m
                    module = min(m, 1)
                    logits, hidden = model.mtp_forward(module, tokens[position + 1].view(1, 1), hidden[:, -1:],
                                                       torch.tensor([[position]]), caches[module])
            assert torch.allclose(result.logits[step][row], logits[0, -1], rtol=1e-4, atol=1e-3), (step, row)


@pytest.fixture(scope="module")
def features(tmp_path_factory):
    """A tiny Qwen2 target and features of it (EAGLE-3's boundaries and the last, as `specdecode train` keeps)."""
    root = tmp_path_factory.mktemp("train-mtp")
    target = load_model(save_tiny_model(root / "t", "qwen2", scale=0.15), dtype="float32")
    layer_ids = feature_layer_ids(target.config.num_layers)
    folder = root / "features"
    check_manifest(folder, {"layer_ids": list(layer_ids), "max_len": 160})
    extract(target, layer_ids, training_texts(), folder, {("train", "code"): 3000, ("held_out", "code"): 600},
            answer_tokens=16, max_len=160, quiet=True)
    return target, folder


def test_tiny_mtp_layers_learn_resume_and_draft_losslessly(features, tmp_path):
    target, folder = features
    settings = TrainSettings(draft_vocab=272, epochs=6, lr=3e-3, eval_every=10)  # byte ids are not by frequency
    curve = []
    first = train_mtp(target, folder, tmp_path / "out", settings, quiet=True,
                      on_eval=lambda step, tokens, accuracy: curve.append((step, accuracy)))
    assert curve[0][0] == 0 and len(curve) >= 3
    assert expected_accepted(curve[-1][1]["code"]) > expected_accepted(curve[0][1]["code"])  # it learns
    assert first["draft_vocab"] == mtp_vocabulary(target, 272).numel() == 272
    interrupted = tmp_path / "again"

    def stop_at_20(step, tokens, accuracy):
        if step == 20:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_mtp(target, folder, interrupted, settings, quiet=True, on_eval=stop_at_20)
    assert train_mtp(target, folder, interrupted, settings, quiet=True) == first  # resumed, bit for bit
    out = tmp_path / "out"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mimo" and config["num_nextn_predict_layers"] == 1
    with_mtp = load_model(out, dtype="float32")
    assert (with_mtp.config.mtp_layers, with_mtp.config.mtp_layout) == (1, "mimo")
    engine = Engine(with_mtp)
    for prompt in ("def mean(values):", "import os\nimport sys\n"):
        sampling = SamplingParams(max_tokens=24, ignore_eos=True)
        plain = Engine(target).complete(prompt, sampling).token_ids
        for spec in (SpecConfig("mtp", guard=False), SpecConfig("mtp", guard=False, options={"mtp_draft_vocab": 200})):
            drafted = engine.complete(prompt, sampling, spec)
            assert drafted.token_ids == plain and drafted.stats.accepted_tokens > 0


def test_a_gguf_target_gets_a_gguf_with_its_nextn_layers(tmp_path, capsys):
    source = save_tiny_model(tmp_path / "t", "llama", scale=0.15)  # llama: q/k rows interleaved in GGUF files
    gguf_path = tmp_path / "tiny.gguf"
    write_gguf(gguf_path, source, "llama", quantized=False)
    args = ["train", "mtp", "--target", str(gguf_path), "--out", str(tmp_path / "out"), "--dtype", "float32",
            "--quant", "none", "--tokens", "600", "--held-out-tokens", "150", "--code-share", "1",
            "--answer-tokens", "8", "--max-len", "96", "--draft-vocab", "100", "--epochs", "1", "--eval-every", "4",
            "--quiet"]
    assert main(args) == 0
    err = capsys.readouterr().err
    written = tmp_path / "out" / "tiny-mtp.gguf"
    assert f"--model {written} --spec-type mtp --mtp-draft-vocab 100" in err
    from_gguf, from_folder = load_model(written, dtype="float32"), load_model(tmp_path / "out", dtype="float32")
    assert from_gguf.config.mtp_layers == from_folder.config.mtp_layers == 1
    assert from_folder.config.mtp_layout == "deepseek"  # a llama trunk: DeepSeek naming
    tokens = list(range(40, 60))
    with torch.inference_mode():
        outputs = []
        for model in (from_gguf.model, from_folder.model):
            trunk = model(torch.tensor([tokens]), torch.arange(20)[None], model.new_cache(20), final_hidden=True)
            outputs.append(model.mtp_forward(0, torch.tensor([tokens[1:]]), trunk.final_hidden[:, :-1],
                                             torch.arange(19)[None], model.new_mtp_cache(20))[0])
    assert torch.allclose(outputs[0], outputs[1], atol=2e-2)  # the same module; float16 in the GGUF file
    # The companion holds the very same modules, for use beside the original file.
    companion = tmp_path / "out" / "mtp-tiny.gguf"
    assert f"--draft-model {companion}" in err
    original = load_model(gguf_path, dtype="float32", quant="none").model
    modules, _ = load_companion(companion, original, "none")
    with torch.inference_mode():
        trunk = original(torch.tensor([tokens]), torch.arange(20)[None], original.new_cache(20), final_hidden=True)
        beside = original.mtp_forward(0, torch.tensor([tokens[1:]]), trunk.final_hidden[:, :-1],
                                      torch.arange(19)[None], original.new_mtp_cache(20), modules=modules)[0]
    assert torch.equal(beside, outputs[0])
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = Engine(load_model(gguf_path, dtype="float32")).complete("hello", sampling).token_ids
    assert Engine(from_gguf).complete("hello", sampling, SpecConfig("mtp")).token_ids == plain
    assert main(["train", "eagle3", "--target", str(gguf_path), "--num-layers", "2"]) == 2
    assert "--num-layers is for train mtp" in capsys.readouterr().err


def test_features_are_shared_between_kinds(features, tmp_path):
    """One feature folder serves both trainers: EAGLE-3 reads its three boundaries, MTP the last."""
    from specdecode.training.eagle3 import train_eagle3

    target, folder = features
    copy = tmp_path / "features"
    shutil.copytree(folder, copy)
    settings = TrainSettings(draft_vocab=48, intermediate_size=64, epochs=1, eval_every=50)
    assert train_eagle3(target, copy, tmp_path / "head", settings, quiet=True)["steps"] > 0
    assert train_mtp(target, copy, tmp_path / "mtp", TrainSettings(draft_vocab=48, epochs=1, eval_every=50),
                     quiet=True)["steps"] > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_a_target_whose_layers_cannot_be_copied_is_one_clear_error(tmp_path, arch):
    """MTP modules and DFlash/DSpark drafters start as copies of the target's last layers: a mixture of experts or
    latent attention cannot be copied into one yet, which is said before any training (EAGLE-3 trains for any)."""
    from specdecode.errors import SpecDecodeError
    from specdecode.training.dflash import new_dflash
    from specdecode.training.mtp import new_modules

    target = load_model(save_tiny_model(tmp_path / arch, arch), dtype="float32")
    with pytest.raises(SpecDecodeError, match="cannot be copied into one yet; 'specdecode train eagle3'"):
        new_modules(target, 1, TrainSettings())
    with pytest.raises(SpecDecodeError, match="DFlash and DSpark drafters start as copies"):
        new_dflash(target, TrainSettings(), 4)
