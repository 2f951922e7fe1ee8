"""`specdecode advise`: every candidate measured against plain decoding on the user's prompts, ranked, with a
command line that runs the winner."""

from __future__ import annotations

import json
import shlex

import pytest
from conftest import save_tiny_model

from specdecode.cli.main import build_parser, main


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("advise")
    target = save_tiny_model(root / "target", "qwen2", scale=0.15)
    draft = save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01)
    return str(target), str(draft)


def test_every_candidate_is_ranked_fastest_first_with_a_runnable_command(models, capsys):
    target, draft = models
    code = main(["advise", "hello hello hello", "abcabcabc abcabc", "--model", target, "--draft-model", draft,
                 "--draft-quant", "none", "--dtype", "float32", "--max-tokens", "16", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    ranking = report["ranking"]
    assert {r["method"] for r in ranking} == {"none", "ngram", "suffix", "recycle", "ngram:ngram_branches=3", "draft",
                                              "ngram+draft", "suffix+draft", "draft:k=5"}
    speeds = [r["tokens_per_second"] for r in ranking]
    assert speeds == sorted(speeds, reverse=True) and all(s > 0 for s in speeds)
    assert all(r["identical_rate"] == 1.0 for r in ranking)  # greedy: every method is lossless
    assert report["best"] == ranking[0]["method"]
    drafting = next(r for r in ranking if r["method"] == "draft")
    assert drafting["weights_bytes"] > next(r for r in ranking if r["method"] == "ngram")["weights_bytes"]
    argv = shlex.split(report["command"])
    assert argv[:3] == ["specdecode", "generate", "PROMPT"] and "--model" in argv
    parsed = build_parser().parse_args(argv[1:])  # the advice is a command line our parser takes
    assert parsed.model == target


def test_candidates_and_a_dataset_can_be_chosen(models, capsys, tmp_path):
    dataset = tmp_path / "mine.jsonl"
    dataset.write_text(json.dumps({"question_id": "a", "category": "x", "turns": ["1 2 3 1 2 3"]}) + "\n")
    code = main(["advise", "--dataset", str(dataset), "--candidates", "ngram:k=2;ngram_max=2", "--model", models[0],
                 "--dtype", "float32", "--max-tokens", "8", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in report["ranking"]] != [] and len(report["ranking"]) == 2
    if report["best"] != "none":
        assert "--ngram-max 2" in report["command"] and "--num-draft-tokens 2" in report["command"]


def test_usage_errors_are_one_line(models, capsys):
    assert main(["advise", "  ", "--model", models[0]]) == 2
    assert main(["advise", "hi", "--model", models[0], "--candidates", "nope"]) == 2
    assert capsys.readouterr().err.count("error:") == 2


def test_methods_in_one_session_do_not_draft_from_each_others_answers(models):
    """'suffix' and 'suffix' at another draft length share a drafter within one Engine; measured side by side,
    the second must not find the first's answer to the same question in the response cache."""
    from specdecode.bench.datasets import Question
    from specdecode.bench.runner import engine_turn_runner, run_question
    from specdecode.bench.suite import parse_methods, runner_factories
    from specdecode.config import SamplingParams, SpecConfig
    from specdecode.engine.engine import Engine
    from specdecode.models.loader import load_model

    engine = Engine(load_model(models[0], dtype="float32"))
    methods = parse_methods("suffix,suffix:k=4", SpecConfig("none"))
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    question = Question("q", "x", ("The quick brown fox",))
    factories = runner_factories(engine, methods, [])
    first = run_question(question, factories["suffix"](sampling))
    second = run_question(question, factories["suffix:k=4"](sampling))
    alone = run_question(question, engine_turn_runner(Engine(engine.target), methods[2].spec, sampling))
    assert first.token_ids == second.token_ids
    assert methods[2].name == "suffix:k=4"
    assert second.stats.accepted_tokens == alone.stats.accepted_tokens
