"""MTP layers a model ships: loaded from each published naming (and GGUF nextn tensors) and checked against the
published forward, found or found missing by `inspect`, and drafted with (the contract suite holds `mtp` to
greedy identity and the target's distribution like every drafter)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from batched_runs import assert_padded_rows_keep_their_bits, drafts_in_shared_forwards
from conftest import save_tiny_model, started
from gguf_files import write_gguf
from mtp_reference import add_mtp_layers, reference_logits

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.cli.main import main
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model

TOKENS = list(range(40, 64))


def module_logits(model, tokens: list[int]) -> torch.Tensor:
    """Our module 0 over `tokens` as the reference runs it -> logits [T-1, V]."""
    count = len(tokens)
    with torch.inference_mode():
        trunk = model(torch.tensor([tokens]), torch.arange(count)[None], model.new_cache(count), final_hidden=True)
        logits, _ = model.mtp_forward(0, torch.tensor([tokens[1:]]), trunk.final_hidden[:, :-1],
                                      torch.arange(count - 1)[None], model.new_mtp_cache(count))
    return logits[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen2 model without MTP layers and its transformers reference."""
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path_factory.mktemp("mtp") / "base", "qwen2", scale=0.15)
    return folder, AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def with_mtp(base, tmp_path, layout: str, **options):
    folder = tmp_path / f"with-{layout}"
    shutil.copytree(base[0], folder)
    return folder, add_mtp_layers(folder, layout, **options)


@pytest.mark.parametrize(("arch", "layout"), [("qwen2", "deepseek"), ("qwen2", "mimo"), ("llama", "deepseek"),
                                              ("qwen3", "deepseek")])
def test_each_naming_loads_and_matches_the_published_forward(tmp_path, arch, layout):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path / arch, arch, scale=0.15)
    reference_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    tensors = add_mtp_layers(folder, layout, shared_copies=layout == "deepseek")
    model = load_model(folder, dtype="float32").model
    assert (model.config.mtp_layers, model.config.mtp_layout) == (1, layout)
    expected = reference_logits(reference_model, tensors, layout, TOKENS)
    assert torch.allclose(module_logits(model, TOKENS), expected, atol=1e-4)  # float32: rounding only


def test_gguf_nextn_tensors_load_as_the_folder_does(base, tmp_path):
    folder, tensors = with_mtp(base, tmp_path, "deepseek")
    path = tmp_path / "with-nextn.gguf"
    write_gguf(path, folder, "qwen2", quantized=False)
    model = load_model(path, dtype="float32", quant="none").model
    assert model.config.mtp_layers == 1 and model.config.num_layers == 3  # block_count counts the nextn block
    expected = reference_logits(base[1], tensors, "deepseek", TOKENS)
    assert torch.allclose(module_logits(model, TOKENS), expected, atol=1e-4)
    if w4a8_unavailable() is None:  # the fast path builds the MTP layers from the file too, and stays bitwise
        engine = Engine(load_model(path, dtype="bfloat16", quant="w4a8"))
        sampling = SamplingParams(max_tokens=16, ignore_eos=True)
        drafted = engine.complete("hello hello", sampling, SpecConfig("mtp", num_draft_tokens=3))
        assert drafted.token_ids == engine.complete("hello hello", sampling).token_ids
        assert drafted.stats.drafted_tokens > 0


def test_plain_decoding_never_runs_the_mtp_layers(base, tmp_path):
    folder, _ = with_mtp(base, tmp_path, "mimo")
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    without = Engine(load_model(base[0], dtype="float32")).complete("hello hello", sampling).token_ids
    assert Engine(load_model(folder, dtype="float32")).complete("hello hello", sampling).token_ids == without


def test_layers_declared_but_dropped_load_without_them_and_say_so(base, tmp_path, capsys):
    folder = tmp_path / "dropped"
    shutil.copytree(base[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    target = load_model(folder, dtype="float32")
    assert (target.config.mtp_layers, target.config.mtp_declared) == (0, 1)
    with pytest.raises(SpecDecodeError, match="declares 1 but the weights do not hold them"):
        Engine(target).complete("hi", SamplingParams(max_tokens=4), SpecConfig("mtp"))
    assert main(["inspect", str(folder)]) == 0
    assert "1 declared in config but dropped from this file" in capsys.readouterr().out


def test_a_part_of_the_layers_or_a_stranger_tensor_is_one_error(base, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, tensors = with_mtp(base, tmp_path, "deepseek")
    mtp_file = folder / "model-mtp.safetensors"
    partial = {k: v for k, v in tensors.items() if "mlp.down_proj" not in k}
    save_file(partial, str(mtp_file))
    with pytest.raises(SpecDecodeError, match="only part of the 1 MTP layers.*mlp.down_proj"):
        load_model(folder, dtype="float32")
    save_file(load_file(str(mtp_file)) | tensors | {"model.layers.3.stranger.weight": torch.ones(2)}, str(mtp_file))
    with pytest.raises(SpecDecodeError, match="unexpected layers.3.stranger.weight"):
        load_model(folder, dtype="float32")


def test_inspect_says_what_a_model_brings(base, tmp_path, capsys):
    folder, _ = with_mtp(base, tmp_path, "mimo")
    assert main(["inspect", str(base[0])]) == 0
    out = capsys.readouterr().out
    assert "MTP layers: none declared" in out and "mtp      no" in out and "suffix   yes" in out
    assert main(["inspect", str(folder), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["mtp"] == {"declared": 1, "present": 1, "naming": "mimo", "dropped": False, "companion": None}
    assert report["architecture"] == "mimo" and report["runs_here"]
    assert report["methods"][0] == {"method": "mtp", "usable": True, "flags": "--spec-type mtp",
                                    "why": "ships 1 MTP layer(s), no other download"}
    gguf_folder, _ = with_mtp(base, tmp_path, "deepseek")
    write_gguf(tmp_path / "m.gguf", gguf_folder, "qwen2", quantized=False)
    assert main(["inspect", str(tmp_path / "m.gguf"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mtp"]["naming"] == "gguf nextn"
    members = Engine(load_model(folder, dtype="float32")).check_spec(SpecConfig("auto")).method
    assert members.split(",")[:2] == ["suffix", "mtp"]


@pytest.fixture(scope="module")
def two_module_engine(base, tmp_path_factory):
    folder, _ = with_mtp(base, tmp_path_factory.mktemp("two"), "deepseek", modules=2, follow=1.0)
    return Engine(load_model(folder, dtype="float32"))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_modules_draft_in_turn_and_the_last_is_reused(two_module_engine, k):
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = two_module_engine.complete("hello hello", sampling).token_ids
    result = two_module_engine.complete("hello hello", sampling, SpecConfig("mtp", num_draft_tokens=k,
                                                                           adaptive=False, guard=False))
    assert result.token_ids == plain
    reused = result.stats.drafter_notes.get("mtp_module_reused", 0)
    assert (reused > 0) == (k > 2), result.stats.drafter_notes  # module 0, then 1, then 1 again


def test_a_reduced_draft_vocabulary_keeps_the_output(two_module_engine):
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = two_module_engine.complete("hello hello", sampling).token_ids
    spec = SpecConfig("mtp", options={"mtp_draft_vocab": 120}, guard=False)
    drafter = two_module_engine.drafter(spec)
    end_of_turn = two_module_engine.target.tokenizer.eos_token_ids
    assert sorted(end_of_turn) == [256, 257]
    # The head's rows: the 120 lowest ids, 6 more to fill the kernel's last 16-row tile with the 2 end of turn
    assert drafter.weights_bytes() == 128 * 64 * 4
    seq = started(two_module_engine, two_module_engine.encode("hello hello"), sampling, spec)
    try:
        proposal = drafter.propose(seq, 3)
        assert all(t < 126 or t in end_of_turn for t in proposal.tokens.tolist())
    finally:
        two_module_engine.finish(seq)
    assert two_module_engine.complete("hello hello", sampling, spec).token_ids == plain


def test_auto_and_advise_use_the_layers_a_target_ships(base, tmp_path, capsys):
    from specdecode.bench.advise import default_candidates

    folder, _ = with_mtp(base, tmp_path, "mimo", follow=1.0)
    assert "mtp,mtp:mtp_draft_vocab=0" in default_candidates(False, ships_mtp=True)
    assert "mtp" not in default_candidates(True)
    args = ["generate", "hello hello", "--model", str(folder), "--max-tokens", "16", "--ignore-eos", "--dtype",
            "float32", "--quant", "none", "--spec-type", "auto", "--compare-plain"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "auto: suffix,mtp with per-step choice" in err and "identical output: True" in err


@pytest.fixture(scope="module")
def w4a8_mtp_engine(base, tmp_path_factory):
    if w4a8_unavailable() is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {w4a8_unavailable()}")
    folder, _ = with_mtp(base, tmp_path_factory.mktemp("w4a8"), "deepseek", modules=2, follow=1.0)
    return Engine(load_model(folder, dtype="bfloat16", quant="w4a8"), draft_quant="w4a8")


@pytest.mark.parametrize("options", [{}, {"mtp_draft_vocab": 120}])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_mtp_drafts_for_a_whole_batch_in_shared_forwards(w4a8_mtp_engine, monkeypatch, options, temperature):
    """In w4a8 the modules run batch-invariantly (fixed-order attention): rows keep their bits beside any other
    sequence, so catch-up and each drafted position run once for every sequence drafting, and each chain is
    what it drafts alone."""
    engine = w4a8_mtp_engine
    model = engine.target.model
    spec = SpecConfig("mtp", num_draft_tokens=3, guard=False, options=options)
    drafter = engine.drafter(spec)
    assert drafter.batch_invariant

    def forward(*args):
        return model.mtp_forward(0, *args, modules=drafter.running)

    assert_padded_rows_keep_their_bits(forward, lambda: model.new_mtp_cache(64), 64, model.dtype)
    calls = drafts_in_shared_forwards(engine, spec, temperature, model, "mtp_forward", monkeypatch)
    shapes = [args[1].shape for args, _ in calls]  # tokens [B, T] of each module forward
    assert any(shape[0] > 1 and shape[1] == 1 for shape in shapes), "no drafted position ran as a batch"
    assert any(shape[0] > 1 and shape[1] > 1 for shape in shapes), "no catch-up ran as a batch"
