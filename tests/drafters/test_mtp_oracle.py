"""The MTP drafter against transformers' own: `generate(use_mtp=True)` (MTPCandidateGenerator over MtpModel) on
tiny random GLM-4.5, DeepSeek-V3 and GLM-4.7-Flash models, greedy, one draft a step (a fixed length: transformers
drafts one token per MTP layer). Every step's draft, at every length of the sequence, must be the token
transformers' candidate generator proposed there, and both outputs plain decoding's.

transformers 5.25 runs use_mtp where the config names `num_mtp_layers` (GLM-4.5's and DeepSeek-V3's do; for
GLM-4.7-Flash the test adds it, and the MTP layer's kind, to config.json, which we do not read). It finds a
checkpoint's MTP weights by the layer numbers the released models use (`_keys_to_ignore_on_load_unexpected`:
GLM-4.5-Air's layer 46, DeepSeek-V3's 61, GLM-4.7-Flash's 47), in the checkpoint's own file: so the tiny models
here are that deep, their MTP tensors in model.safetensors. Qwen 3.5 MoE is left out: on a tiny model with the
same config keys added, transformers' own use_mtp output left its plain greedy output at the fourth token (a 0.54
logit margin between the top two, no near-tie), so it is no oracle there; its MTP module is checked against
transformers' MtpLayer instead (tests/models/families/test_moe.py)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import save_tiny_model
from safetensors.torch import load_file, save_file
from test_glm_moe import add_glm_mtp
from test_mla import add_mtp_module, mla_folder

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.drafters.mtp import MTPDrafter
from specdecode.models.loader import load_model

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]
NEW_TOKENS = 16


def glm4_moe(folder):
    add_glm_mtp(save_tiny_model(folder, "glm4_moe", scale=0.15, num_hidden_layers=46))


def deepseek_v3(folder):
    add_mtp_module(mla_folder(folder, "deepseek_v3", num_hidden_layers=62), follow=1.0)


def glm4_moe_lite(folder):
    add_mtp_module(mla_folder(folder, "glm4_moe_lite", num_hidden_layers=48,
                              mlp_layer_types=["dense"] + ["sparse"] * 47), follow=1.0)
    config = json.loads((folder / "config.json").read_text())
    config |= {"mlp_layer_types": config["mlp_layer_types"][:47], "num_mtp_layers": 1,
               "mtp_mlp_layer_types": ["sparse"]}  # as qwen3_5_moe's: what transformers' generator needs named
    (folder / "config.json").write_text(json.dumps(config))


def one_file(folder) -> None:
    """The MTP tensors moved into model.safetensors, where transformers' MtpModel looks for them."""
    extra = folder / "model-mtp.safetensors"
    if extra.exists():
        weights = load_file(folder / "model.safetensors") | load_file(extra)
        extra.unlink()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def transformers_candidates(folder, monkeypatch) -> tuple[list[int], list[tuple[int, list[int]]]]:
    """transformers' greedy output with use_mtp=True, and each step's (sequence length, candidates)."""
    from transformers import AutoModelForCausalLM
    from transformers.generation import candidate_generator

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 experts_implementation="eager").eval()
    seen, propose = [], candidate_generator.MTPCandidateGenerator.get_candidates

    def recorded(self, input_ids, *args, **kwargs):
        candidates, logits = propose(self, input_ids, *args, **kwargs)
        if candidates.shape[1] > input_ids.shape[1]:  # the first call only lets the main model go first
            seen.append((input_ids.shape[1], candidates[0, input_ids.shape[1]:].tolist()))
        return candidates, logits

    monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "get_candidates", recorded)
    with torch.no_grad():
        output = model.generate(torch.tensor([PROMPT]), use_mtp=True, max_new_tokens=NEW_TOKENS, do_sample=False)
    return output[0, len(PROMPT):].tolist(), seen


def our_drafts(folder, monkeypatch) -> tuple[list[int], list[int], list[tuple[int, list[int]]]]:
    """Our greedy output with `mtp` drafting one token a step, plain decoding's, and each step's drafts."""
    engine = Engine(load_model(folder, dtype="float32"))
    seen, propose = [], MTPDrafter.propose

    def recorded(self, seq, budget):
        proposal = propose(self, seq, budget)
        seen.append((len(seq.tokens), proposal.tokens.tolist()))
        return proposal

    monkeypatch.setattr(MTPDrafter, "propose", recorded)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    plain = engine.complete(PROMPT, greedy, SpecConfig("none")).token_ids
    one_a_step = SpecConfig("mtp", num_draft_tokens=1, adaptive=False, guard=False)
    drafted = engine.complete(PROMPT, greedy, one_a_step).token_ids
    return drafted, plain, seen


@pytest.mark.parametrize("family", [glm4_moe, deepseek_v3, glm4_moe_lite], ids=lambda f: f.__name__)
def test_each_draft_is_the_candidate_transformers_mtp_generator_proposes(tmp_path, monkeypatch, family):
    folder = tmp_path / family.__name__
    family(folder)
    one_file(folder)
    theirs, their_steps = transformers_candidates(folder, monkeypatch)
    ours, plain, our_steps = our_drafts(folder, monkeypatch)
    assert ours == plain, "mtp drafting changed the output"
    assert plain == theirs, "transformers decodes otherwise"
    # transformers drafts until max_new_tokens is reached; we stop drafting one token short of it (nothing to gain)
    compared = [step for step in their_steps if step[0] < len(PROMPT) + NEW_TOKENS - 1]
    assert len(compared) >= NEW_TOKENS // 2 and our_steps[: len(compared)] == compared
