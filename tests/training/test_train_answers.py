"""Training data that looks like use: the target's own answers, many at once, and chat-like prompts filled with
topics the target lists itself."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys

import pytest
from conftest import save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.main import main
from specdecode.cli.train import token_budget
from specdecode.models.loader import load_model
from specdecode.training import chat_tasks
from specdecode.training.answers import Answerer
from specdecode.training.chat_tasks import (
    TEMPLATES,
    TOPIC_REQUESTS,
    TOPICS_FILE,
    chat_prompts,
    chat_topics,
    list_topics,
)
from specdecode.training.data import prompts


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


def test_topic_lists_are_cleaned_and_kept_once(target, tmp_path, monkeypatch):
    lists = ["1. Paris\n2. **Rome**\n- New York\n3. paris\n4. A place with far too many words in its name here",
             'Tea, "coffee", tea, green tea, mat', "Lisbon\nOslo"]

    class Scripted(Answerer):  # the target's sampled lists replaced by the texts above by seed, the second cut short
        def complete(self, prompts, samplings):
            assert len({sampling.seed for sampling in samplings}) > 1  # several lists per kind, each its own seed
            return [(target.tokenizer.encode(lists[sampling.seed % 3]), sampling.seed % 3 != 1)
                    for sampling in samplings]

    topics = list_topics(Scripted(target, 8))
    assert set(topics) == set(TOPIC_REQUESTS)
    assert all(kept == ["Paris", "Rome", "New York", "Tea", "coffee", "green tea", "Lisbon", "Oslo"]
               for kept in topics.values())  # bullets, numbers, quotes, repeats, long and unfinished items dropped
    monkeypatch.setattr(chat_tasks, "LIST_TOKENS", 24)
    listed = chat_topics(target, tmp_path)  # the tiny target's own lists, whatever they are, written once
    assert json.loads((tmp_path / TOPICS_FILE).read_text()) == listed
    monkeypatch.setattr(chat_tasks, "list_topics", lambda answerer: pytest.fail("listed again"))
    assert chat_topics(target, tmp_path) == listed  # read back


def test_chat_prompts_mix_every_kind_of_request_the_same_way_each_run():
    topics = {name: [f"{name} {i}" for i in range(6)] for name in TOPIC_REQUESTS}
    first = list(itertools.islice(chat_prompts(topics), 300))
    assert [text.text for text in first] == [text.text for text in itertools.islice(chat_prompts(topics), 300)]
    assert all(text.kind == "chat" and text.is_prompt and "{" not in text.text for text in first)
    assert len({text.text for text in first}) > 250  # templates, topics and numbers vary
    kinds = len(TEMPLATES) + 3  # the template kinds, math, reasoning and extraction, taken in turn
    for kind, templates in TEMPLATES.items():
        openings = {template.split("{")[0] for template in templates}
        assert any(text.text.startswith(tuple(openings)) for text in first[:kinds]), kind
    assert 0 < sum(text.held_out for text in first) < 60  # about 5% held out, by a hash of the ordinal
    # Kinds whose topic lists came back empty are left out; math and reasoning need none.
    bare = list(itertools.islice(chat_prompts({name: [] for name in TOPIC_REQUESTS}), 10))
    assert len(bare) == 10 and all("{" not in text.text for text in bare)
    # The same in another process, whose string hashes differ (resume relies on the order).
    script = ("import itertools, json, sys; from specdecode.training.chat_tasks import chat_prompts; "
              "print(json.dumps([t.text for t in itertools.islice(chat_prompts(json.loads(sys.argv[1])), 300)]))")
    for hash_seed in ("1", "2"):
        other = subprocess.run([sys.executable, "-c", script, json.dumps(topics)], capture_output=True, text=True,
                               env={**os.environ, "PYTHONHASHSEED": hash_seed}, check=True)
        assert json.loads(other.stdout) == [text.text for text in first]


def test_the_token_budget_splits_training_tokens_between_answers_chat_and_code():
    args = argparse.Namespace(tokens=1000, code_share=0.1, chat_share=0.0, held_out_tokens=50)
    assert token_budget(args) == {("train", "answer"): 900, ("train", "code"): 100, ("held_out", "answer"): 50,
                                  ("held_out", "code"): 50}
    args.code_share = 0.0
    assert ("train", "code") not in token_budget(args)  # answers only; code still held out, to measure it
    args.code_share, args.chat_share = 0.1, 0.5  # the defaults: half the answers to chat-like prompts
    assert token_budget(args) == {("train", "answer"): 450, ("train", "chat"): 450, ("train", "code"): 100,
                                  ("held_out", "answer"): 50, ("held_out", "code"): 50, ("held_out", "chat"): 50}
    args.code_share = 1.0
    assert ("train", "chat") not in token_budget(args)  # no answers, none to chat


def test_train_refuses_shares_out_of_range(tmp_path, capsys):
    assert main(["train", "mtp", "--target", str(tmp_path), "--chat-share", "-0.1"]) == 2
    assert "--chat-share must be in [0, 1]" in capsys.readouterr().err
    assert main(["train", "mtp", "--target", str(tmp_path), "--code-share", "1.5"]) == 2
    assert "--code-share must be in [0, 1]" in capsys.readouterr().err


def test_train_answers_chat_prompts_and_measures_them_apart(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(chat_tasks, "LIST_TOKENS", 24)  # a random tiny model's lists are noise: short noise
    folder = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    out, features = tmp_path / "out", tmp_path / "features"
    args = ["train", "mtp", "--target", str(folder), "--out", str(out), "--features", str(features), "--dtype",
            "float32", "--quant", "none", "--tokens", "600", "--held-out-tokens", "100", "--code-share", "0.3",
            "--answer-tokens", "8", "--max-len", "320", "--draft-vocab", "32", "--epochs", "1", "--eval-every", "4",
            "--quiet"]
    assert main(args) == 0
    kinds = {path.stem.rsplit("-", 1)[1] for split in ("train", "held_out") for path in (features / split).iterdir()}
    assert kinds == {"answer", "chat", "code"} and (features / TOPICS_FILE).exists()
    curve = [json.loads(line) for line in (out / "learning_curve.jsonl").read_text().splitlines()]
    assert set(curve[-1]["held_out_acceptance"]) == {"answer", "chat", "code"}
    assert "chat " in capsys.readouterr().err  # the closing line reports held-out chat apart
    assert main([*args, "--chat-share", "0"]) == 2  # the same folder without chat: other order
    assert "other settings (chat)" in capsys.readouterr().err
