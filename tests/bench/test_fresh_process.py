"""`specdecode bench --fresh-process`: each answer of ours in a process of its own, timed by its request alone."""

from __future__ import annotations

import json

from conftest import save_tiny_model

from specdecode.bench.fresh_process import stats_from_fields
from specdecode.cli import main
from specdecode.engine.stats import GenerationStats
from specdecode.spec_types import ChoiceRecord


def test_stats_travel_between_processes_as_their_fields():
    from dataclasses import asdict

    stats = GenerationStats(method="suffix,draft", new_tokens=7, drafted_tokens=5, step_tokens=9,
                            drafted_per_position=[3, 2], steps_without_draft={"chooser_plain": 2})
    stats.choices["draft"] = ChoiceRecord(steps=2, promised_tokens=3.5, tokens=4, seconds=0.25, drafted=3)
    travelled = stats_from_fields(json.loads(json.dumps(asdict(stats))))
    assert travelled == stats and isinstance(travelled.choices["draft"], ChoiceRecord)


def test_fresh_process_answers_equal_one_process_answers(tmp_path, capsys):
    """Two turns of a question, each answer from its own process (the second fed the first's answer): the same
    tokens as answered in one long-lived process, and each turn records its process's load apart from its
    request. (Each process loads torch and a model: one question and one method keep it to four.)"""
    target = save_tiny_model(tmp_path / "target", "qwen2", scale=0.15)
    questions = tmp_path / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["hello hello", "again please"]},
    ]) + "\n")
    results = {}
    for mode in ("long", "fresh"):
        out = tmp_path / mode
        extra = ["--fresh-process"] if mode == "fresh" else []
        code = main(["bench", "--dataset", str(questions), "--model", str(target), "--dtype", "float32",
                     "--max-tokens", "12", "--methods", "suffix", "--out", str(out), *extra])
        assert code == 0
        capsys.readouterr()
        results[mode] = json.loads((out / "results.json").read_text())
    fresh, long = results["fresh"], results["long"]
    assert fresh["setup"]["process"] == "a fresh one per answer"
    assert long["setup"]["process"] == "one for all answers"
    for method in ("none", "suffix"):
        fresh_runs, long_runs = fresh["questions"][method][0], long["questions"][method][0]
        assert [q["token_ids"] for q in fresh_runs] == [q["token_ids"] for q in long_runs]
        assert len(fresh_runs[0]["token_ids"]) == len(fresh_runs[0]["extra"]) == 2  # two turns, two processes
        assert fresh["summary"][method]["identical_rate"] == 1.0
        for question in fresh_runs:
            assert question["error"] is None and question["stats"]["new_tokens"] == question["new_tokens"]
            assert question["stats"]["method"] == long_runs[0]["stats"]["method"]
            for turn in question["extra"]:
                # The process took its load and warm-up on top of the request the answer is timed by.
                assert turn["process_seconds"] > turn["load_seconds"] > 0


def test_a_failing_answer_process_is_recorded_against_its_question():
    import sys

    from specdecode.bench.datasets import Question
    from specdecode.bench.fresh_process import FreshProcess, fresh_turn_runner
    from specdecode.bench.runner import run_question
    from specdecode.config import SamplingParams, SpecConfig

    failing = "import sys; print('error: no model at /nowhere', file=sys.stderr); sys.exit(1)"
    child = FreshProcess((sys.executable, "-c", failing), {})
    result = run_question(Question("q", "x", ("hi",)), fresh_turn_runner(child, SpecConfig("none"),
                                                                          SamplingParams(max_tokens=4)))
    assert result.error == ("SpecDecodeError: the answer's own process failed (exit 1): error: no model at "
                            "/nowhere")
