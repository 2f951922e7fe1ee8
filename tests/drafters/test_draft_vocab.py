"""A draft model over a reduced vocabulary (draft_vocab): its output head cut to the frequent ids, drafts only among
them, the output unchanged (greedy token for token, sampled by the check tool's distribution test)."""

from __future__ import annotations

import json

import pytest

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
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
    assert first.head is again.head and "draft-head:32:lowest" in engine.resources.own_weights
    assert engine.drafter_weights_bytes() > 0
    vocab = engine.target.config.vocab_size
    assert engine.drafter(SpecConfig("draft", draft_vocab=vocab)).head is None  # not smaller: the own head
    with pytest.raises(SpecDecodeError, match=f"draft_vocab must be at most the target's vocabulary of {vocab}"):
        engine.check_spec(SpecConfig("draft", draft_vocab=vocab + 1))  # a mistake, not "all of it" (#63)


def test_sampled_output_passes_the_distribution_check(noisy_pair, tmp_path, capsys):
    target, draft = noisy_pair
    code = main(["check", "hello hello", "--model", str(target.folder), "--draft-model", str(draft.folder),
                 "--draft-quant", "none", "--dtype", "float32", "--spec-type", "draft", "--draft-vocab", "48",
                 "--max-tokens", "16", "--trials", "300", "--temperature", "1.0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["passed"] and report["sampling"]["drafted"] > 0


def test_counted_ids_take_the_most_emitted_tokens_whole_tiles_and_the_end_tokens():
    import torch

    from specdecode.models.heads.draft_vocab import counted_ids

    counts = torch.zeros(100, dtype=torch.long)
    counts[[90, 40, 7]] = torch.tensor([5, 9, 1])  # emitted most: 40, then 90, then 7
    ids = counted_ids(counts, 3, frozenset({99}))
    assert ids.tolist() == sorted(ids.tolist()) and len(ids) % 16 == 0
    assert {40, 90, 7, 99} <= set(ids.tolist())  # then ids never seen, lowest first, to fill the tile
    never_seen = [i for i in range(100) if i not in {40, 90, 7, 99}]
    assert set(ids.tolist()) - {40, 90, 7, 99} == set(never_seen[: len(ids) - 4])


def test_train_vocab_counts_the_targets_answers_and_draft_vocab_drafts_over_them(noisy_pair, capsys):
    from specdecode.models.formats.drafter_folder import trained_folder
    from specdecode.models.heads.draft_vocab import read_counts

    target, draft = noisy_pair
    code = main(["train", "vocab", "--target", str(target.folder), "--answers", "2", "--answer-tokens", "8",
                 "--dtype", "float32", "--quant", "none", "--quiet"])
    assert code == 0 and "token_counts.json" in capsys.readouterr().err
    counts = read_counts(trained_folder("vocab", str(target.folder)), target.config.vocab_size)
    assert counts is not None and 0 < counts.sum() <= 16  # two answers of at most 8 tokens
    reread = Engine(load_named(target, str(target.folder)), draft)  # the name the counts were made for
    drafter = reread.drafter(SpecConfig("draft", guard=False, options={"draft_vocab": 16}))
    assert set(counts.nonzero().flatten().tolist()) <= set(drafter.head_ids.tolist())
    assert "draft-head:16:counted" in reread.resources.own_weights
    assert reread.complete(PROMPTS[0], GREEDY, SpecConfig("draft", draft_vocab=16)).token_ids == \
        reread.complete(PROMPTS[0], GREEDY).token_ids


def load_named(model, name: str):
    from dataclasses import replace

    return replace(model, name=name)
