"""A draft model over a reduced vocabulary (draft_vocab): its output head cut to the frequent ids, drafts only among
them, the output unchanged (greedy token for token, sampled by the check tool's distribution test)."""

from __future__ import annotations

import json

import pytest

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.main import main

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
PROMPTS = ["hello hello hello", "abcabcabc abc", "The quick brown fox"]


@pytest.fixture(scope="module")
def engine(noisy_pair):
    return Engine(*noisy_pair)


@pytest.mark.parametrize("options", [{}, {"draft_tree_nodes": 6, "draft_tree_width": 2}], ids=["chain", "tree"])
def test_drafts_come_from_the_reduced_vocabulary_and_the_output_is_plain_decodings(engine, options, monkeypatch):
    spec = SpecConfig("draft", guard=False, options={"draft_vocab": 48, **options})
    drafter = engine.drafter(spec)
    allowed = set(drafter.head_ids.tolist())
    assert 48 <= len(allowed) < engine.target.config.vocab_size and len(allowed) % 16 == 0
    drafted = []
    propose = drafter.propose
    monkeypatch.setattr(drafter, "propose", lambda seq, budget: drafted.append(p := propose(seq, budget)) or p)
    for prompt in PROMPTS:
        assert engine.complete(prompt, GREEDY, spec).token_ids == engine.complete(prompt, GREEDY).token_ids
    tokens = {token for proposal in drafted for token in proposal.tokens.tolist()}
    assert tokens and tokens <= allowed


def test_the_reduced_head_is_built_once_and_counted(engine):
    first = engine.drafter(SpecConfig("draft", draft_vocab=32))
    again = engine.drafter(SpecConfig("draft", draft_vocab=32, draft_tree_nodes=4))
    assert first.head is again.head and "draft-head:32" in engine.resources.own_weights
    assert engine.drafter_weights_bytes() > 0
    assert engine.drafter(SpecConfig("draft", draft_vocab=100_000)).head is None  # not smaller: the own head


def test_sampled_output_passes_the_distribution_check(noisy_pair, tmp_path, capsys):
    target, draft = noisy_pair
    code = main(["check", "hello hello", "--model", str(target.folder), "--draft-model", str(draft.folder),
                 "--draft-quant", "none", "--dtype", "float32", "--spec-type", "draft", "--draft-vocab", "48",
                 "--max-tokens", "16", "--trials", "300", "--temperature", "1.0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["sampling"]["drafted"] > 0
