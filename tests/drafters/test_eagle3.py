"""EAGLE-3 heads: each published layout loads, its logits equal a plain re-implementation of the published forward
(eagle3_reference.py, written in the test), the drafter aligns tokens and hidden states as the reference does,
and what users can get wrong ends in one clear error."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from batched_runs import assert_padded_rows_keep_their_bits, drafts_in_shared_forwards
from conftest import TINY_VOCAB, save_tiny_model, started
from eagle3_reference import LAYOUTS, ReferenceHead, head_config, random_head, write_head

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.main import main
from specdecode.cli.options import draft_sources
from specdecode.cli.serve import spec_from_vllm
from specdecode.errors import SpecDecodeError
from specdecode.models.formats.default_models import DEFAULT_DRAFT
from specdecode.models.formats.eagle3 import load_eagle3_head
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model, module_bytes

HIDDEN = 64  # the tiny target's
# Boundary ids each layout's test head is written for, on an 8-layer target (below 8: transformers returns
# hidden_states[8] after the final norm, where our boundary 8, like vLLM's, is before it).
LAYER_IDS = {"reference": [2, 4, 5], "speculators": [1, 4, 7], "specforge": [2, 5, 7]}
DRAFT_IDS = list(range(0, TINY_VOCAB, 3))  # a reduced draft vocabulary: every third token


@pytest.fixture(scope="module")
def target8(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("eagle3") / "target", "llama", scale=0.2,
                             num_hidden_layers=8)
    return load_model(folder, dtype="float32"), folder


def written(tmp_path, layout: str, **options):
    weights = random_head(HIDDEN, TINY_VOCAB, draft_ids=DRAFT_IDS, **options)
    extra = {"norm_before_residual": True} if layout == "speculators" else {}
    config = head_config(weights, TINY_VOCAB, layout, LAYER_IDS[layout], **extra)
    return write_head(tmp_path / layout, weights, config, layout), weights


def hf_states(folder, tokens: list[int]) -> tuple:
    """Hidden states as the EAGLE reference captures them: transformers' output_hidden_states."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens]), output_hidden_states=True).hidden_states


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_logits_equal_the_published_forward(target8, tmp_path, layout):
    target, target_folder = target8
    folder, weights = written(tmp_path, layout)
    head, description = load_eagle3_head(folder, target.model, 512)
    assert head.config.layer_ids == tuple(LAYER_IDS[layout])
    assert head.config.norm_before_residual == (layout == "speculators")
    assert layout.replace("specforge", "SpecForge") in description
    reference = ReferenceHead(weights, target.model.embed.weight.detach(),
                              norm_before_residual=layout == "speculators")
    prompt = [5, 17, 99, 42, 7, 7, 120, 3]
    states = hf_states(target_folder, prompt)
    features = [states[i][0] for i in LAYER_IDS[layout]]  # [T, Ht] each
    with torch.inference_mode():
        fused = head.fuse(features)  # [T, H]
        assert torch.allclose(fused, reference.fuse(features), atol=1e-5)
        cache = head.new_cache(32)
        tokens = prompt[1:] + [11]  # row i pairs token i's features with token i+1
        positions = torch.arange(len(prompt)).unsqueeze(0)
        logits, fed_back = head(torch.tensor([tokens]), fused.unsqueeze(0), positions, cache)
        expected, expected_out = reference.step(tokens, reference.fuse(features), list(range(len(prompt))))
        assert torch.allclose(logits[0], expected, atol=1e-4)
        # A later draft step feeds back the head's own pre-norm output, one position on.
        draft = int(logits[0, -1].argmax())
        logits2, _ = head(torch.tensor([[draft]]), fed_back[:, -1:], torch.tensor([[len(prompt)]]), cache)
        expected2, _ = reference.step([draft], expected_out[-1:], [len(prompt)])
        assert torch.allclose(logits2[0], expected2, atol=1e-4)
    assert int(head.draft_to_target[draft]) == reference.target_id(draft) == DRAFT_IDS[draft]


def test_the_drafter_proposes_what_the_reference_computes(target8, tmp_path):
    """Alignment end to end: the target's prefill features of the prompt, the shift by one token, the draft
    vocabulary's mapping, and the feedback of later steps."""
    target, target_folder = target8
    folder, weights = written(tmp_path, "speculators")
    engine = Engine(target, draft_path=folder)
    spec = SpecConfig("eagle3", num_draft_tokens=3)
    prompt = [5, 17, 99, 42, 7, 7, 120, 3]
    seq = started(engine, prompt, SamplingParams(max_tokens=8), spec)
    try:
        proposal = seq.drafter.propose(seq, 3)
    finally:
        engine.finish(seq)
    states = hf_states(target_folder, prompt)
    reference = ReferenceHead(weights, target.model.embed.weight.detach(), norm_before_residual=True)
    features = reference.fuse([states[i][0] for i in LAYER_IDS["speculators"]])
    logits, out = reference.step(seq.tokens[1:], features, list(range(len(prompt))))
    drafts = []
    for depth in range(3):
        drafts.append(reference.target_id(int(logits[-1].argmax())))
        logits, out = reference.step([drafts[-1]], out[-1:], [len(prompt) + depth])
    assert proposal.tokens.tolist() == drafts


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_output_equals_plain_decoding_on_a_deeper_target(target8, tmp_path, tree):
    folder, _ = written(tmp_path, "reference")
    engine = Engine(target8[0], draft_path=folder)
    options = {"eagle3_tree_nodes": 6, "eagle3_tree_width": 2} if tree else {}
    for prompt in ("abcabcabc", "the the the"):
        plain = engine.complete(prompt, SamplingParams(max_tokens=24, ignore_eos=True), SpecConfig("none"))
        result = engine.complete(prompt, SamplingParams(max_tokens=24, ignore_eos=True),
                                 SpecConfig("eagle3", num_draft_tokens=3, options=options))
        assert result.token_ids == plain.token_ids
        assert result.stats.drafted_tokens > 0
        assert result.stats.drafter_request_bytes > 0
    # The head's own weights count as the drafter's (the shared embedding is the target's), loaded and counted
    # once per Engine however many configurations (chain, tree, chains with other methods) use it.
    head = engine.drafter(SpecConfig("eagle3")).head
    assert engine.drafter(SpecConfig("eagle3", options={"eagle3_tree_nodes": 4})).head is head
    own = module_bytes(head)
    assert engine.drafter_weights_bytes() == own > 0
    assert engine.drafter(SpecConfig("ngram,eagle3")).weights_bytes() == own


def test_a_narrower_head_brings_its_own_embedding(target8, tmp_path):
    target, target_folder = target8
    weights = random_head(HIDDEN, TINY_VOCAB, hidden=48, own_embedding=True)
    config = head_config(weights, TINY_VOCAB, "reference", target_hidden_size=HIDDEN)
    head, _ = load_eagle3_head(write_head(tmp_path / "narrow", weights, config, "reference"), target.model, 512)
    reference = ReferenceHead(weights, target.model.embed.weight.detach())
    states = hf_states(target_folder, [1, 2, 3, 4])
    features = [states[i][0] for i in head.config.layer_ids]  # [4, 64] each, at the head's boundaries
    ids = torch.tensor([[2, 3, 4, 5]])
    with torch.inference_mode():
        logits, _ = head(ids, head.fuse(features).unsqueeze(0), torch.arange(4).unsqueeze(0), head.new_cache(8))
    expected, _ = reference.step([2, 3, 4, 5], reference.fuse(features), [0, 1, 2, 3])
    assert torch.allclose(logits[0], expected, atol=1e-4)
    without = {k: v for k, v in weights.items() if k != "embed_tokens.weight"}
    with pytest.raises(SpecDecodeError, match="needs its own embed_tokens"):
        load_eagle3_head(write_head(tmp_path / "bare", without, config, "reference"), target.model, 512)


def test_a_head_for_another_target_is_one_clear_error(target8, tmp_path):
    target = target8[0].model
    weights = random_head(32, TINY_VOCAB)  # fc reads 3 x 32: a target of hidden size 32
    folder = write_head(tmp_path / "narrow", weights, head_config(weights, TINY_VOCAB, "reference",
                                                                  target_hidden_size=32), "reference")
    with pytest.raises(SpecDecodeError, match="trained for a target of hidden size 32"):
        load_eagle3_head(folder, target, 512)
    weights = random_head(HIDDEN, 300)
    folder = write_head(tmp_path / "vocab", weights, head_config(weights, 300, "reference"), "reference")
    with pytest.raises(SpecDecodeError, match="vocabulary of 300 tokens"):
        load_eagle3_head(folder, target, 512)
    weights = random_head(HIDDEN, TINY_VOCAB)
    config = head_config(weights, TINY_VOCAB, "speculators", [1, 4, 9])  # the target has 8 layers
    folder = write_head(tmp_path / "deep", weights, config, "speculators")
    with pytest.raises(SpecDecodeError, match="within this target's 8 layers"):
        load_eagle3_head(folder, target, 512)


def test_malformed_heads_fail_clearly(target8, tmp_path):
    target = target8[0].model
    weights = random_head(HIDDEN, TINY_VOCAB)
    config = head_config(weights, TINY_VOCAB, "reference")
    two_layers = {**weights, **{k.replace("midlayer.", "layers.1."): v for k, v in weights.items()
                                if k.startswith("midlayer.")}}
    folder = write_head(tmp_path / "two", {k.replace("midlayer.", "layers.0."): v for k, v in two_layers.items()},
                        config, "reference")
    with pytest.raises(SpecDecodeError, match="one-layer"):
        load_eagle3_head(folder, target, 512)
    folder = write_head(tmp_path / "odd", {**weights, "extra.weight": torch.zeros(2)}, config, "reference")
    with pytest.raises(SpecDecodeError, match="unknown tensor 'extra.weight'"):
        load_eagle3_head(folder, target, 512)
    without_q = {k: v for k, v in weights.items() if "q_proj" not in k}
    folder = write_head(tmp_path / "noq", without_q, config, "reference")
    with pytest.raises(SpecDecodeError, match="only some of"):
        load_eagle3_head(folder, target, 512)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecDecodeError, match="no config.json"):
        load_eagle3_head(tmp_path / "empty", target, 512)


def test_a_pickled_head_is_read_only_through_convert(target8, tmp_path, capsys):
    target, target_folder = target8
    weights = random_head(HIDDEN, TINY_VOCAB, draft_ids=DRAFT_IDS)
    folder = tmp_path / "pickled"
    folder.mkdir()
    torch.save(weights, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps(head_config(weights, TINY_VOCAB, "reference")))
    with pytest.raises(SpecDecodeError, match="specdecode convert"):
        load_eagle3_head(folder, target.model, 512)
    assert main(["convert", str(folder)]) == 0
    assert "model.safetensors" in capsys.readouterr().err
    head, _ = load_eagle3_head(folder, target.model, 512)
    expected, _ = load_eagle3_head(write_head(tmp_path / "safe", weights, json.loads(
        (folder / "config.json").read_text()), "reference"), target.model, 512)
    for (name, ours), theirs in zip(head.state_dict().items(), expected.state_dict().values()):
        assert torch.equal(ours, theirs), name
    assert main(["convert", str(folder)]) == 2  # never overwrites
    assert "already" in capsys.readouterr().err


def test_command_line_and_vllm_forms(target8, tmp_path, capsys):
    folder, _ = written(tmp_path, "reference")
    spec, named = spec_from_vllm(json.dumps({"method": "eagle3", "model": str(folder),
                                             "num_speculative_tokens": 2}), SpecConfig())
    assert (spec.method, named, spec.num_draft_tokens) == ("eagle3", str(folder), 2)
    model = str(target8[1])
    common = ["generate", "abcabc", "--model", model, "--max-tokens", "6", "--ignore-eos", "--dtype", "float32",
              "--quant", "none", "--json", "--spec-type", "eagle3"]
    assert main(common) == 2
    assert "needs an EAGLE-3 head: --draft-model PATH" in capsys.readouterr().err
    assert main([*common, "--draft-model", str(folder)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stats"]["method"] == "eagle3" and len(report["token_ids"]) == 6
    assert main([*common, "--draft-head", str(folder), "--spec-type", "eagle3,draft", "--draft-model", model]) == 0
    # serve --spec-type eagle3 --draft-model HEAD --allow-draft-override: the head, and the default draft model
    # for requests that ask for `draft` (only when the target is the default too).
    head_only = argparse.Namespace(draft_head=None, draft_model=str(folder), model=None)
    assert draft_sources(head_only, False, True, load_draft_anyway=True) == (DEFAULT_DRAFT, str(folder))
    assert draft_sources(argparse.Namespace(draft_head=None, draft_model=str(folder), model=model), False, True,
                         load_draft_anyway=True) == (None, str(folder))


@pytest.mark.parametrize("quant", ["int8", "int4", "w4a8"])
def test_a_quantized_head_drafts_losslessly_for_less(target8, tmp_path, quant):
    """--draft-quant applies to a head's own layers: cheaper drafts, the same output."""
    if quant == "w4a8" and w4a8_unavailable():
        pytest.skip(f"the w4a8 kernel does not run here ({w4a8_unavailable()})")
    folder, _ = written(tmp_path, "reference")
    float_engine, engine = Engine(target8[0], draft_path=folder), Engine(target8[0], draft_path=folder,
                                                                         draft_quant=quant)
    head = engine.drafter(SpecConfig("eagle3")).head
    assert not isinstance(head.fc, torch.nn.Linear) and not isinstance(head.layer.attn.qkv, torch.nn.Linear)
    float_engine.drafter(SpecConfig("eagle3"))
    assert engine.drafter_weights_bytes() < float_engine.drafter_weights_bytes()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in ("abcabcabc", "the the the"):
        plain = engine.complete(prompt, params, SpecConfig("none"))
        drafted = engine.complete(prompt, params, SpecConfig("eagle3", guard=False))
        assert drafted.token_ids == plain.token_ids and drafted.stats.drafted_tokens > 0
    with pytest.raises(SpecDecodeError, match="unknown quantization"):
        Engine(target8[0], draft_path=folder, draft_quant="auto")


@pytest.mark.parametrize("variant", ["norm_before_fc", "fc_norm", "norm_output"])
def test_speculators_variants(target8, tmp_path, variant):
    """speculators' options: one RMSNorm over the concatenated states (`input_norm`), one per state
    (`fc_norm.{i}`), and feeding back the normed output ("EAGLE 3.1")."""
    target, target_folder = target8
    weights = random_head(HIDDEN, TINY_VOCAB, draft_ids=DRAFT_IDS)
    generator = torch.Generator().manual_seed(7)
    if variant == "norm_before_fc":
        weights["input_norm.weight"] = 0.5 + torch.rand(3 * HIDDEN, generator=generator)
    elif variant == "fc_norm":
        weights.update({f"fc_norm.{i}.weight": 0.5 + torch.rand(HIDDEN, generator=generator) for i in range(3)})
    config = head_config(weights, TINY_VOCAB, "speculators", LAYER_IDS["speculators"], norm_before_residual=False,
                         **{variant: True})
    head, _ = load_eagle3_head(write_head(tmp_path / variant, weights, config, "speculators"), target.model, 512)
    states = [state[0] for state in hf_states(target_folder, [4, 8, 15, 16, 23])]
    features = [states[i] for i in LAYER_IDS["speculators"]]

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    if variant == "fc_norm":
        features_in = [rms(f, weights[f"fc_norm.{i}.weight"]) for i, f in enumerate(features)]
    else:
        features_in = features
    concatenated = torch.cat(features_in, dim=-1)
    if variant == "norm_before_fc":
        concatenated = rms(concatenated, weights["input_norm.weight"])
    with torch.inference_mode():
        fused = head.fuse(features)
        assert torch.allclose(fused, concatenated @ weights["fc.weight"].T, atol=1e-4)
        reference = ReferenceHead(weights, target.model.embed.weight.detach())
        tokens = [8, 15, 16, 23, 42]
        logits, fed_back = head(torch.tensor([tokens]), fused.unsqueeze(0), torch.arange(5).unsqueeze(0),
                                head.new_cache(8))
        expected, out = reference.step(tokens, fused, list(range(5)))
    assert torch.allclose(logits[0], expected, atol=1e-4)
    expected_back = rms(out, weights["norm.weight"]) if variant == "norm_output" else out
    assert torch.allclose(fed_back[0], expected_back, atol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_w4a8_head_drafts_for_a_whole_batch_in_shared_forwards(tmp_path, monkeypatch, temperature):
    """A w4a8 head over a w4a8 target runs its attention in the fixed-order kernel: rows keep their bits beside
    any other sequence, so catch-up and each drafted position run once for every sequence drafting, and each
    chain is what it drafts alone."""
    if w4a8_unavailable():
        pytest.skip(f"the w4a8 kernel does not run here ({w4a8_unavailable()})")
    target = save_tiny_model(tmp_path / "target", "llama", scale=0.2, num_hidden_layers=8)
    weights = random_head(HIDDEN, TINY_VOCAB, draft_ids=list(range(0, 240, 3)))  # 80 ids: whole 16-row tiles
    folder = write_head(tmp_path / "head", weights, head_config(weights, TINY_VOCAB, "reference",
                                                                LAYER_IDS["reference"]), "reference")
    engine = Engine(load_model(target, dtype="bfloat16", quant="w4a8"), draft_path=folder, draft_quant="w4a8")
    spec = SpecConfig("eagle3", num_draft_tokens=3, guard=False)
    drafter = engine.drafter(spec)
    assert drafter.batch_invariant
    assert_padded_rows_keep_their_bits(drafter.head, lambda: drafter.head.new_cache(64), HIDDEN, drafter.head.dtype)
    calls = drafts_in_shared_forwards(engine, spec, temperature, drafter.head, "forward", monkeypatch)
    shapes = [(args[0].shape[0], "logits_at" in kwargs) for args, kwargs in calls]  # (sequences, a catch-up?)
    assert any(batch > 1 and not catch_up for batch, catch_up in shapes), "no drafted position ran as a batch"
    assert any(batch > 1 and catch_up for batch, catch_up in shapes), "no catch-up ran as a batch"


def test_speculators_heads_saved_with_transformers_5(target8, tmp_path):
    """speculators 0.9 saves with transformers 5: RoPE only under `rope_parameters`, and for a Qwen3 verifier a
    Qwen3-typed layer with q_norm and k_norm. Both are read, and the logits follow the published forward."""
    target, target_folder = target8
    weights = random_head(HIDDEN, TINY_VOCAB, draft_ids=DRAFT_IDS)
    generator = torch.Generator().manual_seed(3)
    weights.update({f"midlayer.self_attn.{name}.weight": 0.6 + 0.8 * torch.rand(16, generator=generator)
                    for name in ("q_norm", "k_norm")})
    config = head_config(weights, TINY_VOCAB, "speculators", LAYER_IDS["speculators"], norm_before_residual=False)
    layer = config["transformer_layer_config"]
    del layer["rope_theta"]
    layer |= {"model_type": "qwen3", "head_dim": 16, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    head, _ = load_eagle3_head(write_head(tmp_path / "qwen3", weights, config, "speculators"), target.model, 512)
    assert head.config.layer.rope_theta == 5e5 and head.layer.attn.q_norm is not None
    states = [state[0] for state in hf_states(target_folder, [4, 8, 15, 16, 23])]
    features = [states[i] for i in LAYER_IDS["speculators"]]
    reference = ReferenceHead(weights, target.model.embed.weight.detach(), theta=5e5)
    tokens = [8, 15, 16, 23, 42]
    with torch.inference_mode():
        fused = head.fuse(features)
        logits, _ = head(torch.tensor([tokens]), fused.unsqueeze(0), torch.arange(5).unsqueeze(0), head.new_cache(8))
        expected, _ = reference.step(tokens, fused, list(range(5)))
    assert torch.allclose(logits[0], expected, atol=1e-4)
    layer["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    head, _ = load_eagle3_head(write_head(tmp_path / "scaled", weights, config, "speculators"), target.model, 512)
    assert head.config.layer.rope_scaling["rope_type"] == "llama3" and head.config.layer.rope_theta == 5e5
    del weights["midlayer.self_attn.k_norm.weight"]
    with pytest.raises(SpecDecodeError, match="only one of self_attn.q_norm and self_attn.k_norm"):
        load_eagle3_head(write_head(tmp_path / "half", weights, config, "speculators"), target.model, 512)
