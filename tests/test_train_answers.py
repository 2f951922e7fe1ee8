"""Training data that looks like use: the target's own answers, many at once, and chat prompts it writes itself
(Magpie) from its chat template's user prefix."""

from __future__ import annotations

import argparse

import pytest
from conftest import save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.main import main
from specdecode.cli.train import token_budget
from specdecode.models.loader import load_model
from specdecode.training import self_prompts as self_prompts_module
from specdecode.training.answers import Answerer
from specdecode.training.data import prompts
from specdecode.training.self_prompts import PROMPTS_FILE, self_prompts, user_prefix, write_prompts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_tiny_model(tmp_path_factory.mktemp("answers") / "t", "qwen2", scale=0.5),
                      dtype="float32")


def test_answers_in_a_batch_are_the_targets_own_greedy_answers(target):
    answerer = Answerer(target, answer_tokens=12)
    texts = [text.text[:60] for text in list(prompts())[:5]]
    ids = [answerer.prompt_ids(text) for text in texts]
    together = answerer.answer(ids)
    alone = Engine(target, spec=SpecConfig("none"))
    for prompt, answer in zip(ids, together):
        assert answer == alone.complete(prompt, SamplingParams(max_tokens=12)).token_ids
    assert answerer.prompt_ids("x" * 600) is None  # no room for an answer in the tiny model's 512 positions


def test_the_target_writes_its_own_chat_prompts_once(target, tmp_path, monkeypatch):
    # A random tiny model ends its turn by chance (one token in 272): a flat law and room let a few prompts end.
    monkeypatch.setattr(self_prompts_module, "TEMPERATURE", 1.0)
    monkeypatch.setattr(self_prompts_module, "PROMPT_TOKENS", 256)
    answerer = Answerer(target, answer_tokens=8)
    prefix = user_prefix(answerer)
    hello = target.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert 0 < len(prefix) < len(hello) and hello[: len(prefix)] == prefix
    assert target.tokenizer.decode(hello[len(prefix) :]).startswith("hello")
    written = self_prompts(target, tmp_path, count=4, batch=4, quiet=True)
    assert 0 < len(written) <= 4 and all(text.is_prompt and len(text.text.split()) >= 4 for text in written)
    assert len({text.text.split()[0] + text.text.split()[1] for text in written}) == len(written)  # distinct
    assert (tmp_path / PROMPTS_FILE).exists()
    assert self_prompts(target, tmp_path, count=4, batch=4, quiet=True) == written  # read back, not written again


def test_written_prompts_that_answer_themselves_or_repeat_are_dropped(target):
    texts = ["Q: what is a list?\n\nA: a sequence of values", "How do I sort a dict by value in Python?",
             "How do I sort a dict by value, fast?", "too short", "Explain how the GIL limits threads."]

    class Scripted(Answerer):  # the target's sampling replaced by the texts above, each ended by itself
        def complete(self, prompts, samplings):
            return [(target.tokenizer.encode(text), True) for text in texts[: len(prompts)]]

    written = write_prompts(Scripted(target, 8), count=5, batch=5)
    assert written == ["How do I sort a dict by value in Python?", "Explain how the GIL limits threads."]


def test_the_token_budget_splits_training_tokens_between_answers_and_code():
    args = argparse.Namespace(tokens=1000, code_share=0.1, held_out_tokens=50)
    assert token_budget(args) == {("train", "answer"): 900, ("train", "code"): 100, ("held_out", "answer"): 50,
                                  ("held_out", "code"): 50}
    args.code_share = 0.0
    assert ("train", "code") not in token_budget(args)  # answers only; code still held out, to measure it


def test_train_refuses_a_negative_chat_prompt_count(tmp_path, capsys):
    assert main(["train", "mtp", "--target", str(tmp_path), "--chat-prompts", "-1"]) == 2
    assert "--chat-prompts must be >= 0" in capsys.readouterr().err
    assert main(["train", "mtp", "--target", str(tmp_path), "--code-share", "1.5"]) == 2
    assert "--code-share must be in [0, 1]" in capsys.readouterr().err
