"""DSpark drafters in vLLM's speculators layout: a DeepSpec-layout drafter rewritten the way
vllm-project/speculators' DSparkSpeculator saves one (code of this test's own, from the layout facts in
drafter-formats.md section 4.2) must draft exactly as the original; a reduced draft vocabulary (`d2t`, `lm_head`
rows, `markov_w2` rows) drafts over its tokens only and stays lossless; speculators' defaults and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_model
from dflash_drafters import write_random_dspark
from safetensors.torch import load_file, save_file
from test_dspark import HEADS, PROMPT, first_block

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models.formats.dflash import load_dflash
from specdecode.models.formats.dspark import load_dspark
from specdecode.models.loader import load_model

HEAD_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_tiny_model(tmp_path_factory.mktemp("dspark") / "t", "qwen2", scale=0.15), dtype="float32")


def write_speculators(folder: Path, deepspec: Path, target, draft_ids: list[int] | None = None, **changes) -> Path:
    """The DeepSpec-layout drafter in `deepspec` as speculators saves a DSparkSpeculator: the layer config nested,
    layer ids as indices into hidden_states (DeepSpec's + 1), the target's embedding and head copied in; with
    `draft_ids`, a reduced vocabulary (lm_head and markov_w2 rows of those tokens, d2t offsets, t2d mask)."""
    deep = json.loads((deepspec / "config.json").read_text())
    moved = {"architectures", "block_size", "num_target_layers", "target_layer_ids", "mask_token_id", "num_anchors",
             *HEAD_KEYS}
    vocab = deep["vocab_size"]
    config = {"speculators_model_type": "dspark", "architectures": ["DSparkSpeculator"],
              "transformer_layer_config": {k: v for k, v in deep.items() if k not in moved},
              "draft_vocab_size": len(draft_ids) if draft_ids else vocab, "block_size": deep["block_size"],
              "target_hidden_size": None, "aux_hidden_state_layer_ids": [i + 1 for i in deep["target_layer_ids"]],
              "mask_token_id": deep["mask_token_id"], "sliding_window_non_causal": False, "sample_from_anchor": True,
              **{key: deep[key] for key in HEAD_KEYS},
              "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy",
                                                           "speculative_tokens": deep["block_size"]}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["Qwen2ForCausalLM"]}}}
    config.update(changes)
    head = target.model.output_rows(torch.arange(vocab))  # [V, H]
    tensors = load_file(deepspec / "model.safetensors")
    tensors["embed_tokens.weight"] = target.model.embed.weight.detach().clone()
    tensors["lm_head.weight"] = head
    if draft_ids:
        ids = torch.tensor(draft_ids)
        tensors["lm_head.weight"] = head[ids].contiguous()
        tensors["markov_head.markov_w2.weight"] = tensors["markov_head.markov_w2.weight"][ids].contiguous()
        tensors["d2t"] = ids - torch.arange(len(ids))
        tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def drafted_block(target, model, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy drafts of the first block after the prompt and their corrected logits [B, V]."""
    hidden, base = first_block(target, model, prompt_ids, prompt_ids[-1])
    previous, state, drafts, laws = torch.tensor(prompt_ids[-1:]), model.start_state(1), [], []
    with torch.inference_mode():
        for slot in range(hidden.shape[0]):
            logits, state = model.slot_logits(base[slot : slot + 1], hidden[slot : slot + 1], previous, state)
            previous = logits.argmax(dim=-1)
            drafts.append(int(previous))
            laws.append(logits[0])
    return drafts, torch.stack(laws)


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_a_speculators_drafter_drafts_as_the_deepspec_original(target, tmp_path, kind):
    original_folder = write_random_dspark(tmp_path / "deepspec", target, HEADS[kind], seed=5)
    original, _ = load_dspark(original_folder, target.model, 128)
    drafter, description = load_dspark(write_speculators(tmp_path / "spec", original_folder, target), target.model,
                                       128)
    assert f"speculators layout, 1 layers, block 4, {kind} Markov head of rank 8, a confidence head" in description
    assert drafter.config.boundary_ids == original.config.boundary_ids
    prompt_ids = target.tokenizer.encode(PROMPT)
    drafts, laws = drafted_block(target, drafter, prompt_ids)
    expected_drafts, expected_laws = drafted_block(target, original, prompt_ids)
    assert drafts == expected_drafts and torch.equal(laws, expected_laws)
    hidden, _ = first_block(target, drafter, prompt_ids, prompt_ids[-1])
    previous = torch.tensor(prompt_ids[-1:])
    assert torch.equal(drafter.confidence_logits(hidden[:1], previous), original.confidence_logits(hidden[:1], previous))


def test_a_reduced_draft_vocabulary_drafts_its_tokens_only_and_stays_lossless(target, tmp_path):
    original_folder = write_random_dspark(tmp_path / "deepspec", target, HEADS["vanilla"], seed=5,
                                          favour=int(target.tokenizer.encode(" a")[0]))
    original, _ = load_dspark(original_folder, target.model, 128)
    prompt_ids = target.tokenizer.encode(PROMPT)
    full_drafts, _ = drafted_block(target, original, prompt_ids)
    vocab = target.config.vocab_size
    draft_ids = sorted(set(range(0, vocab, 3)) | set(full_drafts))
    folder = write_speculators(tmp_path / "reduced", original_folder, target, draft_ids)
    drafter, description = load_dspark(folder, target.model, 128)
    assert f"a {len(draft_ids)}-token draft vocabulary" in description
    drafts, laws = drafted_block(target, drafter, prompt_ids)  # [B, V]
    assert drafts == full_drafts  # every draft of the full vocabulary is in the reduced one, so the same drafts
    others = torch.ones(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(draft_ids), False)
    assert torch.isneginf(laws[:, others]).all() and torch.isfinite(laws[:, draft_ids]).all()
    engine = Engine(target, draft_path=folder)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = engine.complete(PROMPT, sampling, SpecConfig("none")).token_ids
    spec = engine.complete(PROMPT, sampling, SpecConfig("dspark", guard=False, options={"dspark_confidence": 0.0}))
    assert spec.token_ids == plain and spec.stats.drafted_tokens > 0


def test_speculators_defaults_and_errors(target, tmp_path):
    original_folder = write_random_dspark(tmp_path / "deepspec", target, HEADS["gated"])
    # speculators leaves out keys at their defaults: a confidence head that reads the Markov embedding
    folder = write_speculators(tmp_path / "defaults", original_folder, target)
    hf = json.loads((folder / "config.json").read_text())
    for key in ("enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
        del hf[key]
    (folder / "config.json").write_text(json.dumps(hf))
    assert "gated Markov head of rank 8, a confidence head" in load_dspark(folder, target.model, 128)[1]
    for change, message in (({"sample_from_anchor": False}, "sample_from_anchor false"),
                            ({"speculators_model_type": "medusa"}, "speculators 'medusa' drafter"),
                            ({"aux_hidden_state_layer_ids": None}, "needs transformer_layer_config"),
                            ({"aux_hidden_state_layer_ids": [1, 99]}, "not trained for this target")):
        (folder / "config.json").write_text(json.dumps(hf | change))
        with pytest.raises(SpecDecodeError, match=message):
            load_dspark(folder, target.model, 128)
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(SpecDecodeError, match="slot convention.*use --spec-type dspark"):
        load_dflash(folder, target.model, 128)
