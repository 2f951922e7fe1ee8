"""The Gemma 4 assistant (models/families/gemma4/assistant.py, drafters/gemma_assistant.py): its draft logits against
transformers' Gemma4AssistantForCausalLM fed the way transformers' candidate generator feeds it, with the full
output head and the centroid head; `mtp` finding it beside the model or named; lossless drafting, greedy and
sampled (the centroid head gives most tokens no probability, which rejection sampling must handle exactly)."""

from __future__ import annotations

import shutil

import pytest
import torch
from gemma_reference import SMALL, reference_model, save_assistant, save_gemma
from test_engine_distribution import SETTINGS, VOCAB, assert_follows_the_target

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.drafters.assistant import assistant_path
from specdecode.drafters.auto import AutoDrafter
from specdecode.drafters.base import DrafterResources
from specdecode.drafters.mtp import MTPDrafter
from specdecode.errors import SpecDecodeError
from specdecode.models.families.gemma4.assistant_format import load_assistant
from specdecode.models.loader import load_model

PROMPT = 20  # tokens: more than twice the sliding window (8)
STEPS = 3


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    return save_gemma(tmp_path_factory.mktemp("assistant") / "gemma-t")


def reference_drafts(target_folder, assistant_folder, ids: torch.Tensor) -> list[torch.Tensor]:
    """transformers: the target's prompt forward, then STEPS assistant calls as its candidate generator makes them
    (the target's last hidden state and its next token's embedding first, then the assistant's own; the position
    of that token every step; the target's shared keys and values) -> each step's logits [V]."""
    from transformers import Gemma4AssistantForCausalLM

    target = reference_model(target_folder)
    assistant = Gemma4AssistantForCausalLM.from_pretrained(str(assistant_folder), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.inference_mode():
        out = target(ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
        hidden, token = out.hidden_states[-1][:, -1:], out.logits[:, -1:].argmax(-1)  # [1, 1, B], [1, 1]
        rows = []
        for _ in range(STEPS):
            inputs = torch.cat([target.get_input_embeddings()(token), hidden], dim=-1)
            step = assistant(inputs_embeds=inputs, position_ids=torch.tensor([[ids.shape[1]]]),
                             shared_kv_states=dict(out.shared_kv_states), use_cache=False)
            rows.append(step.logits[0, 0])
            hidden, token = step.last_hidden_state, step.logits.argmax(-1)
    return rows


@pytest.mark.parametrize("centroids", [0, 16], ids=["output-head", "centroid-head"])
def test_draft_logits_match_transformers(target_folder, tmp_path, centroids):
    assistant_folder = save_assistant(tmp_path / "assistant", target_folder, centroids=centroids)
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    expected = reference_drafts(target_folder, assistant_folder, ids)
    target = load_model(target_folder, dtype="float32", quant="none").model
    assistant, description = load_assistant(assistant_folder, target.config, torch.float32, torch.device("cpu"),
                                            "none")
    assert ("centroid head" in description) == bool(centroids)
    slots = {kind: target.shared_slot(kind) for kind in ("sliding_attention", "full_attention")}
    with torch.inference_mode():
        cache = target.new_cache(PROMPT)
        out = target(ids, torch.arange(PROMPT).unsqueeze(0), cache, final_hidden=True)
        hidden, token = out.final_hidden[:, -1:], out.logits[0, -1].argmax()
        for reference in expected:
            logits, hidden = assistant(target.embed_scaled(token.view(1, 1)), hidden, PROMPT, cache, slots)
            scored = torch.isfinite(logits)  # [V]: the centroid head scores its top clusters' tokens only
            assert int(scored.sum()) == (2 * 272 // 16 if centroids else 272)
            assert (logits[scored] - reference[scored]).abs().max() < 1e-4
            assert int(logits.argmax()) == int(reference.argmax())
            token = logits.argmax()
        assert cache.lengths == [PROMPT]  # the assistant wrote nothing


def greedy(max_tokens: int = 32) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def test_mtp_finds_the_assistant_beside_the_model_and_drafts_losslessly(tmp_path):
    target_folder = save_gemma(tmp_path / "gemma-4-tiny-it")
    save_assistant(tmp_path / "gemma-4-tiny-it-assistant", target_folder, follow=True)
    target = load_model(target_folder, dtype="float32", quant="none")
    engine = Engine(target)
    drafted = accepted = 0
    for prompt in ("hello hello hello", "1 2 3 1 2 3 1 2"):
        plain = engine.complete(prompt, greedy(), SpecConfig("none")).token_ids
        result = engine.complete(prompt, greedy(), SpecConfig("mtp", num_draft_tokens=4))
        assert result.token_ids == plain
        drafted, accepted = drafted + result.stats.drafted_tokens, accepted + result.stats.accepted_tokens
    assert 0 < accepted < drafted
    resources = DrafterResources(target)
    assert "Gemma 4 assistant" in MTPDrafter.found_for(resources)
    assert "mtp" in [name for name, _ in AutoDrafter.members(resources)]  # auto drafts with it too


def test_the_assistant_named_with_draft_model_is_used(tmp_path):
    target_folder = save_gemma(tmp_path / "t")
    elsewhere = save_assistant(tmp_path / "elsewhere" / "a", target_folder, follow=True)
    target = load_model(target_folder, dtype="float32", quant="none")
    assert assistant_path(DrafterResources(target)) is None
    assert assistant_path(DrafterResources(target, draft_path=str(elsewhere))) == elsewhere
    engine = Engine(target, draft_path=str(elsewhere))
    plain = engine.complete("hello hello", greedy(), SpecConfig("none")).token_ids
    result = engine.complete("hello hello", greedy(), SpecConfig("mtp", num_draft_tokens=3))
    assert result.token_ids == plain and result.stats.accepted_tokens > 0


def test_an_assistant_for_another_model_is_one_clear_error(tmp_path):
    target_folder = save_gemma(tmp_path / "t")
    other = save_gemma(tmp_path / "other", hidden_size=96, hidden_size_per_layer_input=8)
    assistant = save_assistant(tmp_path / "a", other)
    target = load_model(target_folder, dtype="float32", quant="none")
    with pytest.raises(SpecDecodeError, match="for another model: backbone_hidden_size 96"):
        load_assistant(assistant, target.config, torch.float32, torch.device("cpu"), "none")


def test_a_gemma_without_an_assistant_says_what_mtp_needs(tmp_path):
    target = load_model(save_gemma(tmp_path / "t"), dtype="float32", quant="none")
    with pytest.raises(SpecDecodeError, match="Gemma 4 assistant"):
        MTPDrafter.check_resources(DrafterResources(target))


@pytest.fixture(scope="module")
def small_vocab_gemma(tmp_path_factory):
    """A Gemma 4 target over VOCAB tokens with a centroid-head assistant (4 clusters, the top 2 scored: half the
    tokens get no draft probability each step). Small weights keep the target's law spread over the tokens (the
    embedding scale and soft cap make larger ones nearly deterministic)."""
    root = tmp_path_factory.mktemp("gemma-vocab8")
    target_folder = save_gemma(root / "t", scale=0.12, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB,
                               bos_token_id=0, eos_token_id=1, **SMALL)
    save_assistant(root / "t-assistant", target_folder, centroids=4, follow=True)
    return Engine(load_model(target_folder, dtype="float32", quant="none"))


@pytest.mark.usefixtures("single_thread")
def test_sampled_drafts_follow_the_target_distribution(small_vocab_gemma):
    spec = SpecConfig("mtp", num_draft_tokens=2, adaptive=False)
    results = assert_follows_the_target(small_vocab_gemma, SETTINGS["temperature"], spec)
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_inspect_lists_the_assistant_beside_the_model(tmp_path):
    from specdecode.models.survey import drafters_beside

    target_folder = save_gemma(tmp_path / "m")
    assistant = save_assistant(tmp_path / "m-assistant", target_folder)
    shutil.copytree(assistant, target_folder / "assistant")
    kinds = drafters_beside(target_folder, [])
    assert ("gemma4_assistant", assistant) in kinds and ("gemma4_assistant", target_folder / "assistant") in kinds


def test_a_gemma4_assistant_gguf_file_drafts_as_its_folder(target_folder, tmp_path):
    """llama.cpp's gemma4-assistant layout (its converter drops the centroid head, so a folder with the full
    output head is the reference): the same draft logits, and `mtp` takes the file from --draft-model."""
    from gguf_gemma4_files import write_gemma4_assistant_gguf

    folder = save_assistant(tmp_path / "assistant", target_folder, follow=True)
    path = tmp_path / "gemma-assistant.gguf"
    write_gemma4_assistant_gguf(path, folder)
    target = load_model(target_folder, dtype="float32", quant="none")
    model = target.model
    from_folder, _ = load_assistant(folder, model.config, torch.float32, torch.device("cpu"), "none")
    from_file, _ = load_assistant(path, model.config, torch.float32, torch.device("cpu"), "none")
    ids = torch.randint(0, 256, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    slots = {kind: model.shared_slot(kind) for kind in ("sliding_attention", "full_attention")}
    with torch.inference_mode():
        cache = model.new_cache(PROMPT)
        out = model(ids, torch.arange(PROMPT).unsqueeze(0), cache, final_hidden=True)
        embedding = model.embed_scaled(out.logits[:, -1:].argmax(-1))
        expected, _ = from_folder(embedding, out.final_hidden[:, -1:], PROMPT, cache, slots)
        got, _ = from_file(embedding, out.final_hidden[:, -1:], PROMPT, cache, slots)
    assert torch.allclose(got, expected, atol=1e-5)
    engine = Engine(target, draft_path=str(path))
    plain = engine.complete("hello hello", greedy(), SpecConfig("none")).token_ids
    result = engine.complete("hello hello", greedy(), SpecConfig("mtp", num_draft_tokens=3))
    assert result.token_ids == plain and result.stats.accepted_tokens > 0
