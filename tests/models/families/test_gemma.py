"""Gemma 4's text trunk (models/families/gemma4/trunk.py) against transformers' Gemma4ForCausalLM on tiny random configs:
every part at once (PLE, KV-shared layers with the double-wide MLP, full layers with their own head size, KV
heads and values from keys, proportional rope, a sliding window shorter than the prompt, soft-capped logits),
none of them, and the multimodal checkpoint's layout. Logits agree within 1e-4 (float32, softcap 30)."""

from __future__ import annotations

import pytest
import torch
from gemma_reference import PLAIN, reference_model, save_gemma

from specdecode.models.families import family_of
from specdecode.models.families.gemma4.trunk import GemmaTransformer
from specdecode.models.loader import load_model, read_config

TOLERANCE = 1e-4
PROMPT = 20  # tokens: more than twice the sliding windows


@pytest.fixture(scope="module", params=["full_featured", "plain", "multimodal"])
def gemma_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"gemma-{request.param}")
    overrides = PLAIN if request.param == "plain" else {}
    return save_gemma(folder, multimodal=request.param == "multimodal", **overrides)


def prompt_ids(length: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(3))  # [1, T]


def test_logits_match_transformers(gemma_folder):
    ours = load_model(gemma_folder, dtype="float32", quant="none").model
    assert isinstance(ours, GemmaTransformer)
    ids = prompt_ids()
    with torch.inference_mode():
        reference = reference_model(gemma_folder)(ids).logits  # [1, T, V]
        logits = ours(ids, torch.arange(PROMPT).unsqueeze(0), ours.new_cache(PROMPT)).logits
    assert (logits - reference).abs().max() < TOLERANCE


def test_decoding_a_token_at_a_time_matches_one_forward(gemma_folder):
    """The cache (sliding and full slots, the KV-shared layers reading theirs) gives each new token the keys and
    values one forward over the whole sequence gives it."""
    ours = load_model(gemma_folder, dtype="float32", quant="none").model
    ids = prompt_ids()
    with torch.inference_mode():
        whole = ours(ids, torch.arange(PROMPT).unsqueeze(0), ours.new_cache(PROMPT)).logits
        cache = ours.new_cache(PROMPT)
        rows = [ours(ids[:, :7], torch.arange(7).unsqueeze(0), cache).logits]
        for t in range(7, PROMPT):
            rows.append(ours(ids[:, t : t + 1], torch.tensor([[t]]), cache).logits)
    assert (torch.cat(rows, dim=1) - whole).abs().max() < TOLERANCE


def test_the_final_hidden_state_is_what_the_head_reads(gemma_folder):
    ours = load_model(gemma_folder, dtype="float32", quant="none").model
    ids = prompt_ids(6)
    with torch.inference_mode():
        out = ours(ids, torch.arange(6).unsqueeze(0), ours.new_cache(6), final_hidden=True)
        assert torch.allclose(ours.soft_cap(ours.lm_head(out.final_hidden).float()), out.logits)


def test_w4a8_follows_the_float_model(tmp_path):
    """The w4a8 build quantizes every linear layer (PLE's among them) and runs close to float: the same top
    token at most positions of a random model."""
    from specdecode.models.kernels.w4a8_linear import w4a8_unavailable

    if (reason := w4a8_unavailable()) is not None:
        pytest.skip(f"w4a8 cannot run here: {reason}")
    folder = save_gemma(tmp_path / "g", hidden_size=128, intermediate_size=256, hidden_size_per_layer_input=32)
    ids = prompt_ids()
    positions = torch.arange(PROMPT).unsqueeze(0)
    with torch.inference_mode():
        float_model = load_model(folder, dtype="float32", quant="none").model
        quantized = load_model(folder, dtype="bfloat16", quant="w4a8").model
        expected = float_model(ids, positions, float_model.new_cache(PROMPT)).logits.argmax(-1)
        got = quantized(ids, positions, quantized.new_cache(PROMPT)).logits.argmax(-1)
    assert (expected == got).float().mean() >= 0.8


def test_the_config_is_read_from_either_naming(gemma_folder):
    config = read_config(gemma_folder)
    assert config.architecture == "gemma4" and family_of(config).name == "gemma4"
    assert config.family_parts.sliding_window in (5, 8)


@pytest.mark.parametrize("quant", ["none", "w4a8"])
def test_a_gemma4_gguf_file_loads_as_its_folder(gemma_folder, tmp_path, quant):
    """llama.cpp's gemma4 layout (tests/gguf_files.py writes it as its converter does): the same model as the
    folder it was written from, in float (logits within 1e-4) and on the w4a8 kernel (within the kernel's own
    rounding of the same weights: the same top token at most positions)."""
    from gguf_gemma4_files import write_gemma4_gguf

    from specdecode.models.kernels.w4a8_linear import w4a8_unavailable

    if quant == "w4a8" and (reason := w4a8_unavailable()) is not None:
        pytest.skip(f"w4a8 cannot run here: {reason}")
    path = tmp_path / "gemma.gguf"
    write_gemma4_gguf(path, gemma_folder)
    dtype = "float32" if quant == "none" else "bfloat16"
    from_file = load_model(path, dtype=dtype, quant=quant)
    from_folder = load_model(gemma_folder, dtype=dtype, quant=quant).model
    assert from_file.config.family_parts == from_folder.config.family_parts
    ids = prompt_ids()
    positions = torch.arange(PROMPT).unsqueeze(0)
    with torch.inference_mode():
        expected = from_folder(ids, positions, from_folder.new_cache(PROMPT)).logits
        got = from_file.model(ids, positions, from_file.model.new_cache(PROMPT)).logits
    if quant == "none":
        assert (got - expected).abs().max() < TOLERANCE
    else:
        assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8
