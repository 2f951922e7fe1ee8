"""Qwen 3.5 from a GGUF file in llama.cpp's qwen35 layout (gguf_qwen35.py): the same model as its Hugging Face folder,
with and without the MTP module, in float and on the w4a8 kernel."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, save_tiny_model
from gguf_files import write_qwen35_gguf
from hybrid_reference import add_hybrid_mtp

from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model
from specdecode.models.survey import survey


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35")
    return add_hybrid_mtp(save_tiny_model(root / "hf", "qwen3_5", scale=0.15), follow=1.0) and root / "hf"


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids, torch.arange(ids.shape[1]).unsqueeze(0), model.new_cache(ids.shape[1])).logits


IDS = torch.randint(0, TINY_VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("mtp", [True, False], ids=["with-nextn", "no-mtp"])
def test_a_qwen35_gguf_is_the_model_its_folder_is(folder, tmp_path, mtp):
    path = tmp_path / "m.gguf"
    write_qwen35_gguf(path, folder, mtp=mtp)
    facts = survey(path)
    assert facts.runs and facts.mtp_present == (1 if mtp else 0)
    ours = load_model(path, dtype="float32", quant="none").model
    expected = load_model(folder, dtype="float32").model
    assert ours.config.layer_types == expected.config.layer_types and ours.config.mtp_layers == (1 if mtp else 0)
    # 1 + w and -exp(A_log) round in float32 on the way in and out: not bitwise, within float32's rounding
    assert torch.allclose(logits(ours, IDS), logits(expected, IDS), atol=1e-5, rtol=1e-5)
    if mtp:
        for name, value in expected.mtp.state_dict().items():
            assert torch.allclose(ours.mtp.state_dict()[name], value, atol=1e-6), name


def test_a_qwen35_gguf_quantizes_to_the_same_w4a8_model_as_its_folder(folder, tmp_path):
    """Value heads reordered back before quantizing: the same groups, so the same codes and bitwise the same
    logits. (A tiny random hybrid's w4a8 logits are far from its float ones: its gated norm rescales per-head
    outputs near zero, amplifying 4-bit noise; the comparison that means something is this one.)"""
    reason = w4a8_unavailable()
    if reason is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {reason}")
    path = tmp_path / "m.gguf"
    write_qwen35_gguf(path, folder)
    from_gguf = logits(load_model(path, dtype="bfloat16", quant="w4a8").model, IDS)
    from_folder = logits(load_model(folder, dtype="bfloat16", quant="w4a8").model, IDS)
    assert torch.isfinite(from_gguf).all() and torch.equal(from_gguf, from_folder)


def test_llama_cpps_split_qwen35_files_draft_as_one_file_does(folder, tmp_path):
    """`convert_hf_to_gguf.py --no-mtp` then `--mtp`: the trunk file, and mtp-NAME.gguf with the MTP module alone
    beside it. The mtp drafter finds the companion and drafts exactly as with the module inside one file; the
    companion loaded as a model is one clear error."""
    from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
    from specdecode.models.formats.mtp_companion import companion_beside

    whole, split = tmp_path / "whole" / "m.gguf", tmp_path / "split" / "m.gguf"
    for path, part in ((whole, "all"), (split, "trunk"), (split.with_name("mtp-m.gguf"), "mtp")):
        path.parent.mkdir(exist_ok=True)
        write_qwen35_gguf(path, folder, part=part)
    assert companion_beside(split) == split.with_name("mtp-m.gguf")
    sampling, spec = SamplingParams(max_tokens=20, ignore_eos=True), SpecConfig("mtp", guard=False)
    runs = []
    for path in (whole, split):
        engine = Engine(load_model(path, dtype="float32", quant="none"))
        plain = engine.complete("hello hello", sampling, SpecConfig("none")).token_ids
        result = engine.complete("hello hello", sampling, spec)
        assert result.token_ids == plain
        runs.append((result.token_ids, result.stats.drafted_tokens, result.stats.accepted_tokens))
    assert runs[0] == runs[1] and runs[0][1] > 0
    with pytest.raises(SpecDecodeError, match="holds only MTP layers"):
        load_model(split.with_name("mtp-m.gguf"), dtype="float32", quant="none")


def test_a_qwen35moe_gguf_with_its_mtp_module_is_the_model_its_folder_is(tmp_path):
    """Qwen 3.5 MoE as llama.cpp's converter writes it (qwen35moe: experts stacked, the shared expert's gate
    squeezed to [H], norms as 1 + w, the MTP block as blk.{L} with its sparse block)."""
    from test_moe import add_qwen3_5_moe_mtp

    folder = save_tiny_model(tmp_path / "hf", "qwen3_5_moe", scale=0.15)
    add_qwen3_5_moe_mtp(folder, follow=1.0)
    path = tmp_path / "m.gguf"
    write_qwen35_gguf(path, folder)
    ours = load_model(path, dtype="float32", quant="none").model
    expected = load_model(folder, dtype="float32").model
    assert ours.config.moe == expected.config.moe and ours.config.mtp_layers == 1
    # 1 + w rounds in float32 on the way in and out (one ulp on the norms), which the experts' sums carry further
    # than the dense model's: within 1e-5 of the largest logit
    ours_logits, expected_logits = logits(ours, IDS), logits(expected, IDS)
    assert (ours_logits - expected_logits).abs().max() <= 1e-5 * expected_logits.abs().max()
    for name, value in expected.mtp.state_dict().items():
        assert torch.allclose(ours.mtp.state_dict()[name], value, atol=1e-6), name
