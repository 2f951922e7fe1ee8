"""DSpark: DeepSpec's layout read and written, the Markov and confidence heads against a plain reimplementation of
DeepSpec's published forward (written here from the stored tensors, not from our modules), the confidence cut
never changing the output, and the loader's errors. The backbone is DFlash's, checked against the authors' code
in test_dflash.py; the contract suite holds `dspark` to greedy identity and the target's distribution."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import save_tiny_model, started
from dflash_drafters import write_random_dspark
from safetensors.torch import load_file, save_file

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models.formats.dspark import load_dspark, save_dspark
from specdecode.models.heads.dspark import DSparkHeads
from specdecode.models.loader import load_model

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):"
HEADS = {"vanilla": DSparkHeads(markov_rank=8, markov_kind="vanilla", confidence_with_markov=False),
         "gated": DSparkHeads(markov_rank=8, markov_kind="gated"),
         "rnn": DSparkHeads(markov_rank=8, markov_kind="rnn")}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_tiny_model(tmp_path_factory.mktemp("dspark") / "t", "qwen2", scale=0.15), dtype="float32")


def published_forward(stored: dict[str, torch.Tensor], heads: DSparkHeads, hidden: torch.Tensor,
                      base: torch.Tensor, root: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """DeepSpec's greedy block (markov_head.py, draft_ops.py) from the stored tensors: hidden [B, H] the
    backbone's slots, base [B, V] their head logits -> (drafts, corrected logits [B, V], confidence logits [B])."""
    w1, w2 = stored["markov_head.markov_w1.weight"], stored["markov_head.markov_w2.weight"]  # [V, r] each
    state = torch.zeros(w1.shape[1])
    previous, drafts, logits, confidence = root, [], [], []
    for k in range(hidden.shape[0]):
        e = w1[previous]  # [r]
        if heads.markov_kind == "gated":
            gate = torch.sigmoid(stored["markov_head.gate_proj.weight"] @ torch.cat([hidden[k], e])
                                 + stored["markov_head.gate_proj.bias"])
            bias = w2 @ (gate * e)
        elif heads.markov_kind == "rnn":
            joint = stored["markov_head.joint_proj.weight"] @ torch.cat([state, e, hidden[k]]) \
                + stored["markov_head.joint_proj.bias"]
            g, c, o = joint.chunk(3)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            bias = w2 @ torch.tanh(o)
        else:
            bias = w2 @ e
        features = torch.cat([hidden[k], e]) if heads.confidence_with_markov else hidden[k]
        confidence.append(stored["confidence_head.proj.weight"][0] @ features + stored["confidence_head.proj.bias"][0])
        logits.append(base[k] + bias)
        previous = int(logits[-1].argmax())
        drafts.append(previous)
    return drafts, torch.stack(logits), torch.stack(confidence)


def first_block(target, model, prompt_ids: list[int], root: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The backbone's block after the prompt -> (hidden [B, H], head logits [B, V])."""
    ids = model.config.boundary_ids
    with torch.inference_mode():
        out = target.model(torch.tensor([prompt_ids]), torch.arange(len(prompt_ids))[None],
                           target.model.new_cache(len(prompt_ids)), hidden_layers=ids)
        cache = model.new_cache(64)
        model.add_context(torch.cat([out.hidden[i][0] for i in ids], dim=-1), torch.arange(len(prompt_ids)), cache)
        block = torch.tensor([root] + [model.config.mask_token_id] * (model.config.block_size - 1))
        hidden = model.block_hidden(block, torch.arange(len(prompt_ids), len(prompt_ids) + len(block)), cache)
        return hidden, model.head_logits(hidden)


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_heads_match_deepspecs_forward_and_drafting(target, tmp_path, kind):
    folder = write_random_dspark(tmp_path / kind, target, HEADS[kind], seed=3)
    model, description = load_dspark(folder, target.model, 128)
    assert f"{kind} Markov head of rank 8" in description and "a confidence head" in description
    stored = load_file(folder / "model.safetensors")
    prompt_ids = target.tokenizer.encode(PROMPT)
    engine = Engine(target, draft_path=folder)
    seq = started(engine, prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True),
                       SpecConfig("dspark", options={"dspark_confidence": 0.0}))
    root = seq.tokens[-1]  # the target's first token: the block's slot 0
    hidden, base = first_block(target, model, prompt_ids, root)
    drafts, expected, confidence = published_forward(stored, HEADS[kind], hidden, base, root)
    state, previous, ours = model.start_state(1), torch.tensor([root]), []
    with torch.inference_mode():
        for k in range(hidden.shape[0]):
            assert torch.allclose(model.confidence_logits(hidden[k : k + 1], previous), confidence[k : k + 1],
                                  atol=1e-5)
            logits, state = model.slot_logits(base[k : k + 1], hidden[k : k + 1], previous, state)
            ours.append(logits[0])
            previous = torch.tensor([drafts[k]])
    assert torch.allclose(torch.stack(ours), expected, atol=1e-5)
    # Every slot drafts (slot 0 the token after the root): the drafter's first proposal is DeepSpec's block.
    proposal = seq.drafter.propose(seq, 8)
    assert proposal.tokens.tolist() == drafts


def test_the_layout_is_deepspecs_and_reads_back_the_same(target, tmp_path):
    folder = write_random_dspark(tmp_path / "a", target, HEADS["gated"])
    stored = load_file(folder / "model.safetensors")
    hf = json.loads((folder / "config.json").read_text())
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "markov_head.gate_proj.weight",
            "markov_head.gate_proj.bias", "confidence_head.proj.weight", "confidence_head.proj.bias", "fc.weight",
            "hidden_norm.weight", "norm.weight", "layers.0.self_attn.k_proj.weight"} <= set(stored)
    assert stored["markov_head.markov_w1.weight"].shape == (target.config.vocab_size, 8)
    assert stored["confidence_head.proj.weight"].shape == (1, target.config.hidden_size + 8)
    assert hf["architectures"] == ["Qwen3DSparkModel"] and hf["target_layer_ids"] == [0, target.config.num_layers - 1]
    assert (hf["markov_rank"], hf["markov_head_type"], hf["enable_confidence_head"],
            hf["confidence_head_with_markov"]) == (8, "gated", True, True)
    model, _ = load_dspark(folder, target.model, 128)
    save_dspark(model, tmp_path / "b", target.config, anchors=16)
    again, _ = load_dspark(tmp_path / "b", target.model, 128)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    # DeepSpec stores frozen copies of the target's embedding and head: they load, and the target's are used.
    shutil.copytree(folder, tmp_path / "copies")
    (tmp_path / "copies" / "model.safetensors").unlink()
    save_file(stored | {"embed_tokens.weight": target.model.embed.weight.detach().clone(),
                        "lm_head.weight": torch.zeros(target.config.vocab_size, target.config.hidden_size)},
              tmp_path / "copies" / "model.safetensors")
    load_dspark(tmp_path / "copies", target.model, 128)


def test_the_confidence_cut_never_changes_the_output(target, tmp_path):
    """Always cut, sometimes, never: greedy output is plain decoding's token for token."""
    cut = {}
    for bias in (-20.0, 0.0, 20.0):
        folder = write_random_dspark(tmp_path / str(bias), target, HEADS["gated"], scale=0.05,
                                     confidence_bias=bias)
        engine = Engine(target, draft_path=folder)
        sampling = SamplingParams(max_tokens=24, ignore_eos=True)
        plain = engine.complete(PROMPT, sampling, SpecConfig("none")).token_ids
        result = engine.complete(PROMPT, sampling, SpecConfig("dspark", guard=False,
                                                              options={"dspark_confidence": 0.5}))
        assert result.token_ids == plain, bias
        cut[bias] = result.stats.drafter_notes.get("dspark_confidence_cut", 0), result.stats.drafted_tokens
    assert cut[-20.0][0] > 0 and cut[-20.0][1] == 0  # every block cut before its first slot: nothing verified
    assert cut[20.0][0] == 0 and cut[20.0][1] > 0


def test_block_size_option_and_errors(target, tmp_path):
    folder = write_random_dspark(tmp_path / "e", target, HEADS["vanilla"], block=4)
    engine = Engine(target, draft_path=folder)
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    full = engine.complete(PROMPT, sampling, SpecConfig("dspark", guard=False, options={"dspark_confidence": 0.0}))
    assert len(full.stats.drafted_per_position) == 4  # every slot drafts: B = 4 drafts a block
    short = engine.complete(PROMPT, sampling, SpecConfig("dspark", guard=False,
                                                         options={"dspark_confidence": 0.0, "dspark_block_size": 2}))
    assert short.token_ids == full.token_ids and len(short.stats.drafted_per_position) == 2
    with pytest.raises(SpecDecodeError, match="dspark_confidence must be at least 0 and below 1"):
        engine.complete(PROMPT, sampling, SpecConfig("dspark", options={"dspark_confidence": 1.5}))
    hf = json.loads((folder / "config.json").read_text())
    for change, message in (({"markov_head_type": "lstm"}, "markov_head_type one of"),
                            ({"markov_rank": 0, "confidence_head_with_markov": True}, "needs a Markov head"),
                            ({"num_target_layers": 9}, "not trained for this target")):
        (folder / "config.json").write_text(json.dumps(hf | change))
        with pytest.raises(SpecDecodeError, match=message):
            load_dspark(folder, target.model, 128)
    (folder / "config.json").write_text(json.dumps(hf))
    stored = load_file(folder / "model.safetensors")
    save_file(stored | {"d2t": torch.zeros(4, dtype=torch.long)}, folder / "model.safetensors")
    with pytest.raises(SpecDecodeError, match="d2t maps 4 draft tokens but lm_head is missing"):
        load_dspark(folder, target.model, 128)


def test_inspect_finds_a_dspark_drafter_beside_the_model(target, tmp_path, capsys):
    from specdecode.cli.main import main

    shutil.copytree(target.folder, tmp_path / "target")
    write_random_dspark(tmp_path / "target-dspark", target, HEADS["vanilla"])
    assert main(["inspect", str(tmp_path / "target"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"kind": "dspark", "path": str(tmp_path / "target-dspark")} in report["drafters_beside"]
    row = next(m for m in report["methods"] if m["method"] == "dspark")
    assert row["usable"] and row["flags"] == f"--spec-type dspark --draft-head {tmp_path / 'target-dspark'}"
    assert not next(m for m in report["methods"] if m["method"] == "dflash")["usable"]


def test_each_layout_is_refused_by_the_other_method(target, tmp_path):
    from dflash_drafters import write_random_dflash

    from specdecode.models.formats.dflash import load_dflash

    dspark = write_random_dspark(tmp_path / "s", target, DSparkHeads(markov_rank=0, confidence=False))
    with pytest.raises(SpecDecodeError, match="DeepSpec's slot convention.*use --spec-type dspark"):
        load_dflash(dspark, target.model, 128)
    load_dspark(dspark, target.model, 128)  # DeepSpec's DFlash baseline: no heads, every slot drafts
    with pytest.raises(SpecDecodeError, match="z-lab's layout.*use --spec-type dflash"):
        load_dspark(write_random_dflash(tmp_path / "f", target), target.model, 128)
