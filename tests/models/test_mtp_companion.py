"""MTP layers in a GGUF file of their own (llama.cpp's `convert_hf_to_gguf.py --no-mtp` then `--mtp`): found
beside the trunk's file or named with --draft-model, checked against the target, drafted with exactly as the
same layers inside one file, and reported by `inspect` and `auto`."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from conftest import save_tiny_model
from gguf_files import write_gguf
from mtp_reference import add_mtp_layers, reference_logits
from safetensors.torch import load_file, save_file

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.cli.main import main
from specdecode.cli.options import draft_sources
from specdecode.models.formats.mtp_companion import companion_beside
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model
from specdecode.models.model_files import load_companion

TOKENS = list(range(40, 64))
SAMPLING = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """A tiny Qwen2 model with one MTP layer as three GGUF files: whole/model.gguf (layers inside), and
    split/model.gguf (the trunk) with split/mtp-model.gguf (the layers) beside it; plus the reference."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("companion")
    base = save_tiny_model(root / "base", "qwen2", scale=0.15)
    reference = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    folder = root / "with-mtp"
    shutil.copytree(base, folder)
    tensors = add_mtp_layers(folder, "deepseek", shared_copies=True)
    for part, path in (("all", root / "whole" / "model.gguf"), ("trunk", root / "split" / "model.gguf"),
                       ("mtp", root / "split" / "mtp-model.gguf")):
        path.parent.mkdir(exist_ok=True)
        write_gguf(path, folder, "qwen2", quantized=False, part=part)
    return root, reference, tensors


def test_the_companion_is_found_beside_the_trunk_and_matches_the_published_forward(split):
    root, reference, tensors = split
    trunk_file, companion = root / "split" / "model.gguf", root / "split" / "mtp-model.gguf"
    assert companion_beside(trunk_file) == companion
    assert companion_beside(root / "whole" / "model.gguf") is None  # no file named mtp-* beside it
    target = load_model(trunk_file, dtype="float32", quant="none")
    assert target.config.mtp_layers == 0 and target.config.num_layers == 3
    model = target.model
    modules, description = load_companion(companion, model, "none")
    assert description == "1 MTP layer(s) from the companion file mtp-model.gguf"
    count = len(TOKENS)
    with torch.inference_mode():
        trunk = model(torch.tensor([TOKENS]), torch.arange(count)[None], model.new_cache(count), final_hidden=True)
        logits, _ = model.mtp_forward(0, torch.tensor([TOKENS[1:]]), trunk.final_hidden[:, :-1],
                                      torch.arange(count - 1)[None], model.new_mtp_cache(count), modules=modules)
    expected = reference_logits(reference, tensors, "deepseek", TOKENS)
    assert torch.allclose(logits[0], expected, atol=1e-4)  # float32: rounding only


def test_drafting_from_the_companion_equals_drafting_from_one_file(split):
    root = split[0]
    whole = Engine(load_model(root / "whole" / "model.gguf", dtype="float32", quant="none"))
    beside = Engine(load_model(root / "split" / "model.gguf", dtype="float32", quant="none"))
    spec = SpecConfig("mtp", num_draft_tokens=3, guard=False)  # drafted counts compared: nothing timed decides them
    one_file, companion = (engine.complete("hello hello", SAMPLING, spec) for engine in (whole, beside))
    assert companion.token_ids == one_file.token_ids == beside.complete("hello hello", SAMPLING).token_ids
    assert (companion.stats.drafted_tokens, companion.stats.accepted_tokens) == \
        (one_file.stats.drafted_tokens, one_file.stats.accepted_tokens) and companion.stats.drafted_tokens > 0


@pytest.mark.skipif(w4a8_unavailable() is not None, reason="the w4a8 kernel needs AVX-512 VNNI, AVX2 or NEON")
def test_a_companion_beside_a_w4a8_target_drafts_losslessly_bit_for_bit(split):
    engine = Engine(load_model(split[0] / "split" / "model.gguf", dtype="bfloat16", quant="w4a8"), draft_quant="w4a8")
    drafted = engine.complete("hello hello", SAMPLING, SpecConfig("mtp", num_draft_tokens=3))
    assert drafted.token_ids == engine.complete("hello hello", SAMPLING).token_ids
    assert drafted.stats.drafted_tokens > 0


def test_a_companion_named_elsewhere_is_read_and_its_weights_counted(split, tmp_path):
    root = split[0]
    elsewhere = tmp_path / "mtp-downloaded.gguf"
    shutil.copy(root / "split" / "mtp-model.gguf", elsewhere)
    alone = tmp_path / "trunk"
    alone.mkdir()
    shutil.copy(root / "split" / "model.gguf", alone / "model.gguf")  # no companion beside this copy
    target = load_model(alone / "model.gguf", dtype="float32", quant="none")
    with pytest.raises(SpecDecodeError, match="nor an MTP companion file"):
        Engine(target).complete("hi", SAMPLING, SpecConfig("mtp"))
    engine = Engine(target, draft_path={"mtp": str(elsewhere)})
    drafted = engine.complete("hello hello", SAMPLING, SpecConfig("mtp"))
    assert drafted.token_ids == engine.complete("hello hello", SAMPLING).token_ids
    assert drafted.stats.drafted_tokens > 0
    # The CLI's --draft-model names it for mtp, as llama.cpp's -md does with --spec-type draft-mtp.
    args = argparse.Namespace(draft_head=None, draft_model=str(elsewhere), model=str(alone / "model.gguf"))
    assert draft_sources(args, False, True) == (None, str(elsewhere))
    assert main(["generate", "hello hello", "--model", str(alone / "model.gguf"), "--spec-type", "draft-mtp",
                 "--draft-model", str(elsewhere), "--dtype", "float32", "--quant", "none", "--max-tokens", "8"]) == 0


def test_a_companion_for_another_model_or_not_a_companion_is_one_error(split, tmp_path):
    root = split[0]
    target = load_model(root / "split" / "model.gguf", dtype="float32", quant="none").model
    with pytest.raises(SpecDecodeError, match="is not an MTP companion file"):
        load_companion(root / "whole" / "model.gguf", target, "none")
    with pytest.raises(SpecDecodeError, match="come as a GGUF file"):
        load_companion(root / "with-mtp", target, "none")
    other = save_tiny_model(tmp_path / "other", "qwen2", scale=0.15, num_hidden_layers=2)
    add_mtp_layers(other, "deepseek")
    write_gguf(tmp_path / "mtp-other.gguf", other, "qwen2", quantized=False, part="mtp")
    with pytest.raises(SpecDecodeError, match="holds MTP layers for another model: num_layers 2 against the "
                                              "target's 3"):
        load_companion(tmp_path / "mtp-other.gguf", target, "none")
    # The same sizes but a block without a tensor the target's blocks have (a model with other biases or norms).
    lacking = tmp_path / "lacking"
    shutil.copytree(root / "with-mtp", lacking)
    mtp_file = lacking / "model-mtp.safetensors"
    save_file({k: v for k, v in load_file(mtp_file).items() if "mlp.down_proj" not in k}, str(mtp_file))
    write_gguf(tmp_path / "mtp-lacking.gguf", lacking, "qwen2", quantized=False, part="mtp")
    with pytest.raises(SpecDecodeError, match="its MTP layers do not fit the target \\(missing "
                                              "layers.3.mlp.down_proj.weight\\)"):
        load_companion(tmp_path / "mtp-lacking.gguf", target, "none")


def test_beside_a_draft_model_a_drafter_without_its_weights_says_so_itself():
    """A chain of MTP layers (optional weights) and a draft model needs no --draft-head; EAGLE-3 there says what
    it lacks when it is built."""
    args = argparse.Namespace(draft_head=None, draft_model="some-draft", model="some-target")
    assert draft_sources(args, True, True) == ("some-draft", None)


def test_inspect_and_auto_see_the_companion(split, capsys):
    trunk_file = split[0] / "split" / "model.gguf"
    assert main(["inspect", str(trunk_file)]) == 0
    out = capsys.readouterr().out
    assert "MTP layers: 1 in the companion file mtp-model.gguf beside it" in out
    assert "mtp      yes  1 MTP layer(s) in mtp-model.gguf beside it" in out
    assert main(["inspect", str(trunk_file), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mtp"]["companion"] == str(split[0] / "split" / "mtp-model.gguf")
    assert report["methods"][0]["usable"]
    members = Engine(load_model(trunk_file, dtype="float32", quant="none")).check_spec(SpecConfig("auto")).method
    assert members.split(",")[:2] == ["suffix", "mtp"]
