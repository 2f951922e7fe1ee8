"""The benchmark: metric definitions against hand-computed numbers, and an end-to-end run on a tiny model."""

from __future__ import annotations

import json

import pytest
from conftest import save_tiny_model

from specdecode.bench.datasets import load_questions
from specdecode.bench.metrics import ceiling_speedup, first_divergence, identical_rate, mean_tokens_per_second, speedup
from specdecode.bench.runner import QuestionResult
from specdecode.cli import main
from specdecode.config import SpecConfig
from specdecode.errors import SpecDecodeError


def result(qid: str, tokens: int, seconds: float, ids=None, error=None) -> QuestionResult:
    return QuestionResult(qid, "c", tokens, seconds, ids or [[1, 2, 3]], None, error)


def test_tokens_per_second_is_mean_of_per_question_rates():
    # 100 tokens in 10 s and 10 tokens in 0.5 s: per-question rates 10 and 20 -> mean 15 (not 110/10.5).
    assert mean_tokens_per_second([result("a", 100, 10.0), result("b", 10, 0.5)]) == pytest.approx(15.0)


def test_speedup_is_a_ratio_of_means_and_skips_failed_questions():
    method = [result("a", 100, 5.0), result("b", 10, 0.25), result("c", 1, 0.0, error="peer failed")]
    baseline = [result("a", 100, 10.0), result("b", 10, 0.5)]
    # means: (20 + 40) / 2 = 30 over (10 + 20) / 2 = 15.
    assert speedup(method, baseline) == pytest.approx(2.0)


@pytest.mark.parametrize(("alpha", "k", "c", "expected"), [
    (0.8, 3, 0.0, (1 - 0.8**4) / 0.2),  # free drafts: expected tokens per forward, 2.952
    (0.8, 3, 0.1, (1 - 0.8**4) / 0.2 / 1.3),
    (1.0, 4, 0.5, 5 / 3),  # everything accepted: k+1 tokens for k*c+1 forwards' worth of time
    (0.0, 3, 0.2, 1 / 1.6),  # nothing accepted: pure overhead
    (0.5, 0, 0.3, 1.0),  # no drafting
])
def test_ceiling_formula(alpha, k, c, expected):
    assert ceiling_speedup(alpha, k, c) == pytest.approx(expected)


def test_identical_rate_and_first_divergence():
    baseline = [result("a", 3, 1, [[1, 2, 3]]), result("b", 4, 1, [[1, 2], [3, 4]])]
    method = [result("a", 3, 1, [[1, 2, 3]]), result("b", 4, 1, [[1, 2], [3, 9]])]
    rate, divergences = identical_rate(method, baseline)
    assert rate == 0.5 and divergences == {"b": 3}  # position counted across turns
    assert first_divergence([[1, 2]], [[1, 2, 3]]) == 2  # a shorter output diverges where it ends


def test_dataset_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n{"question_id": 2, "turns": "oops"}\n')
    with pytest.raises(SpecDecodeError, match=r"q.jsonl:2: not a Spec-Bench question"):
        load_questions([str(bad)])
    with pytest.raises(SpecDecodeError, match="dataset file not found"):
        load_questions([str(tmp_path / "missing.jsonl")])
    good = tmp_path / "g.jsonl"
    good.write_text('{"question_id": 1, "category": "x", "turns": ["hi"]}\n')
    with pytest.raises(SpecDecodeError, match="no questions in categories nope"):
        load_questions([str(good)], categories=["nope"])


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target = save_tiny_model(root / "target", "qwen2", scale=0.15)
    draft = save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01)
    questions = root / "questions.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["hello hello", "again please"]},
        {"question_id": 2, "category": "coding", "turns": ["abcabcabc"]},
        {"question_id": 3, "category": "coding", "turns": ["1 2 3 1 2 3"]},
    ]) + "\n")
    return str(target), str(draft), str(questions)


def test_end_to_end_bench_writes_every_file(tiny_pair, tmp_path, capsys):
    target, draft, questions = tiny_pair
    out = tmp_path / "out"
    code = main(["bench", "--dataset", questions, "--model", target, "--draft-model", draft, "--dtype", "float32",
                 "--max-tokens", "16", "--methods", "draft,ngram,ngram+draft:k=5", "--peer", "hf",
                 "--repeats", "2", "--out", str(out)])
    assert code == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(last) == {"none", "draft", "ngram", "ngram+draft:k=5", "hf:plain", "hf:assisted", "hf:prompt-lookup"}
    for summary in last.values():
        assert set(summary) == {"tokens_per_second", "speedup", "mean_accepted_length", "acceptance_rate",
                                "identical_rate", "ceiling_speedup"}
    assert last["none"]["speedup"] == 1.0 and last["none"]["mean_accepted_length"] == 1.0
    assert all(last[m]["identical_rate"] == 1.0 for m in ("draft", "ngram", "ngram+draft:k=5"))
    results = json.loads((out / "results.json").read_text())
    assert len(results["questions"]["draft"]) == 2 and len(results["questions"]["draft"][0]) == 3
    assert len(results["questions"]["draft"][0][0]["token_ids"]) == 2  # two turns
    assert set(results["by_category"]["ngram"]) == {"writing", "coding"}
    assert "speedup_vs_ours_plain" in results["summary"]["hf:assisted"]
    report = (out / "report.md").read_text()
    assert "| ngram+draft:k=5 |" in report and "Definitions" in report
    for plot in ("speedup_by_category.png", "acceptance_by_position.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("extra", "message"), [
    (["--methods", "warp"], "unknown speculative method 'warp'"),
    (["--methods", "ngram:q=1"], "bad method option 'q=1'"),
    (["--categories", "poetry"], "no questions in categories poetry"),
])
def test_bench_bad_input_is_one_clear_error(tiny_pair, capsys, extra, message):
    target, _, questions = tiny_pair
    code = main(["bench", "--dataset", questions, "--model", target, "--dtype", "float32", "--max-tokens", "4",
                 *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


class _StreamingChatServer:
    """A loopback server speaking the streaming chat-completions protocol; fails every request after `ok`."""

    def __init__(self, ok: int):
        import http.server
        import threading

        state = {"served": 0}

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                self._send(200, "application/json", json.dumps({"data": [{"id": "tiny"}]}).encode())

            def do_POST(self):
                json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                state["served"] += 1
                if state["served"] > ok:
                    self._send(500, "application/json", b'{"error": {"message": "boom"}}')
                    return
                chunks = [{"choices": [{"delta": {"content": word}}]} for word in ("one ", "two ", "three")]
                chunks.append({"choices": [], "usage": {"completion_tokens": 3},
                               "timings": {"draft_n": 4, "draft_n_accepted": 3}})
                body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
                self._send(200, "text/event-stream", body.encode())

            def _send(self, code, kind, body):
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_openai_peer_streams_and_records_failures_per_question(tiny_pair, tmp_path, capsys):
    target, _, questions = tiny_pair
    # Warm-up takes one request and the 3 questions need 4 turns: the 5th request (question 3) fails.
    server = _StreamingChatServer(ok=4)
    try:
        code = main(["bench", "--dataset", questions, "--model", target, "--dtype", "float32", "--max-tokens", "8",
                     "--methods", "ngram", "--peer", f"openai={server.url},name=fake", "--out", str(tmp_path)])
    finally:
        server.close()
    assert code == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "openai:fake" in last and last["openai:fake"]["identical_rate"] is None  # text-only API
    results = json.loads((tmp_path / "results.json").read_text())
    runs = results["questions"]["openai:fake"][0]
    assert [r["error"] is None for r in runs] == [True, True, False] and "500" in runs[2]["error"]
    assert runs[0]["new_tokens"] == 6 and runs[0]["extra"][0]["timings"]["draft_n_accepted"] == 3
    assert results["summary"]["openai:fake"]["errors"] == 1
    assert results["summary"]["openai:fake"]["speedup"] > 0  # measured against our plain decoding
    assert results["summary"]["openai:fake"]["time_to_first_token"] >= 0


def test_unreachable_peer_is_skipped_and_the_rest_reported(tiny_pair, capsys, caplog):
    target, _, questions = tiny_pair
    code = main(["bench", "--dataset", questions, "--model", target, "--dtype", "float32", "--max-tokens", "4",
                 "--methods", "ngram", "--peer", "openai=http://127.0.0.1:9,name=gone"])
    out = capsys.readouterr().out
    assert code == 0 and "unreachable" in caplog.text
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last) == {"none", "ngram"}


def test_humaneval_comes_from_the_package_in_specbench_wording():
    questions = load_questions(["humaneval"], limit=3)
    assert [q.question_id for q in questions] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert questions[0].category == "humaneval" and len(questions[0].turns) == 1
    assert questions[0].turns[0].startswith("Complete the code I provided.from typing import List")


def test_top2_gap_reads_the_target_at_the_diverging_token(tiny_pair):
    import torch

    from specdecode import Engine, SamplingParams, SpecConfig
    from specdecode.bench.datasets import Question
    from specdecode.bench.divergence import top2_gap
    from specdecode.models.loader import load_model

    engine = Engine(load_model(tiny_pair[0], dtype="float32"))
    question = Question("q", "c", ("hello", "again"))
    first = engine.complete([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=5, ignore_eos=True),
                            SpecConfig("none"))
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first.text},
                {"role": "user", "content": "again"}]
    second = engine.complete(messages, SamplingParams(max_tokens=5, ignore_eos=True), SpecConfig("none"))
    reference = [first.token_ids, second.token_ids]
    # Position 7 is the third token of the second turn.
    prefix = engine.encode(messages) + second.token_ids[:2]
    with torch.inference_mode():
        logits = engine.target.model(torch.tensor([prefix]), torch.arange(len(prefix)).unsqueeze(0),
                                     engine.target.model.new_cache(len(prefix))).logits[0, -1]
    top = torch.topk(logits, 2).values
    assert top2_gap(engine, question, reference, 7) == pytest.approx(float(top[0] - top[1]), abs=1e-5)
    assert logits.argmax().item() == second.token_ids[2]  # the reference's own greedy choice at that point


def test_per_category_keeps_the_first_questions_of_each_category(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"question_id": i, "category": "ab"[i % 2], "turns": [f"q{i}"]} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [q.question_id for q in load_questions([str(path)], per_category=2)] == ["0", "1", "2", "3"]
    assert [q.question_id for q in load_questions([str(path)], per_category=2, limit=3)] == ["0", "1", "2"]


@pytest.mark.parametrize(("rule", "identical"), [((), 1.0), (("--verification", "block"), None)],
                         ids=["coupled", "block"])
def test_a_sampled_bench_reports_identity_only_where_the_rule_promises_it(tiny_pair, capsys, rule, identical):
    """At a seed the coupled rule (the default then) makes every method's output plain decoding's; block does not."""
    target, draft, questions = tiny_pair
    code = main(["bench", "--dataset", questions, "--model", target, "--draft-model", draft, "--dtype", "float32",
                 "--max-tokens", "6", "--methods", "draft", "--temperature", "0.8", "--seed", "1", *rule])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and last["draft"]["identical_rate"] == identical


def test_report_lists_each_divergence_with_its_top2_gap():
    from specdecode.bench.report import divergence_lines

    summaries = {"none": {"divergences": {}},
                 "draft": {"divergences": {"q7": {"position": 12, "top2_gap": 0.125, "near_tie": True}}},
                 "hf:assisted": {"divergences": {"q3": 40}}}
    lines = divergence_lines(summaries)
    assert "| draft | q7 | 12 | 0.125 | yes |" in lines
    assert "| hf:assisted | q3 | 40 | - | - |" in lines
    assert divergence_lines({"none": {"divergences": {}}}) == []


def test_methods_fix_or_adapt_the_draft_length_each():
    from specdecode.bench.suite import parse_methods

    specs = {s.name: s.spec for s in parse_methods("ngram,ngram:k=2;adaptive=off", SpecConfig("none"))}
    assert specs["ngram"].adaptive and not specs["ngram:k=2;adaptive=off"].adaptive
    assert specs["ngram:k=2;adaptive=off"].num_draft_tokens == 2
    fixed = SpecConfig("none", adaptive=False)
    assert parse_methods("ngram:adaptive=on", fixed)[1].spec.adaptive
    with pytest.raises(SpecDecodeError, match="adaptive=on\\|off"):
        parse_methods("ngram:adaptive=maybe", fixed)


def test_weights_a_drafter_loads_itself_load_in_the_warm_up_not_in_a_measured_question(tiny_pair, monkeypatch):
    """Every runner has its own Engine, but a drafter's own weights (here the draft model's reduced head) are
    shared: the warm-up loads them once, and the measured runner's first question finds them loaded."""
    from specdecode.bench.datasets import Question
    from specdecode.bench.runner import run_question
    from specdecode.bench.suite import parse_methods, runner_factories
    from specdecode.config import SamplingParams
    from specdecode.drafters import draft_model
    from specdecode.engine.engine import Engine
    from specdecode.models.loader import load_model

    loads = []
    real = draft_model.reduced_head
    monkeypatch.setattr(draft_model, "reduced_head", lambda *args: loads.append(args) or real(*args))
    engine = Engine(load_model(tiny_pair[0], dtype="float32"), load_model(tiny_pair[1], dtype="float32"))
    methods = parse_methods("draft:draft_vocab=64", SpecConfig("none"))
    factory = runner_factories(engine, methods, [])["draft:draft_vocab=64"]
    question = Question("q", "x", ("hello hello",))
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    run_question(question, factory(sampling))  # the warm-up's runner
    assert len(loads) == 1
    measured = run_question(question, factory(sampling))
    assert len(loads) == 1
    assert measured.stats.drafted_tokens > 0  # it drafted, through the head the warm-up loaded


def test_auto_is_set_against_the_fastest_single_method_overall_and_per_category():
    from specdecode.bench.metrics import against_fastest
    from specdecode.bench.report import against_fastest_lines

    summaries = {"draft": {"tokens_per_second": 40.0}, "suffix": {"tokens_per_second": 30.0},
                 "auto": {"tokens_per_second": 38.0}}
    categories = {"draft": {"code": {"tokens_per_second": 50.0}, "math": {"tokens_per_second": 20.0}},
                  "suffix": {"code": {"tokens_per_second": 10.0}, "math": {"tokens_per_second": 25.0}},
                  "auto": {"code": {"tokens_per_second": 45.0}, "math": {"tokens_per_second": 25.0}}}
    against = against_fastest("auto", ["draft", "suffix"], summaries, categories)
    assert against == {"fastest": "draft", "ratio": 0.95,
                       "by_category": {"code": {"fastest": "draft", "ratio": 0.9},
                                       "math": {"fastest": "suffix", "ratio": 1.0}}}
    summaries["auto"]["against_fastest_single"] = against
    assert "| auto | 0.950 (draft) | 0.900 (draft) | 1.000 (suffix) |" in against_fastest_lines(summaries)


def test_each_runner_of_one_process_warms_up_for_its_method_as_a_users_process_does(tiny_pair, monkeypatch):
    """A one-process runner's Engine warms up for its own method (engine/warm_up.py), so its per-step choice prices
    the draft model by the warm measure a user's `serve` or `generate` has: warmed for plain decoding, it priced it
    by its first timing alone (#62)."""
    from specdecode.bench.suite import parse_methods, runner_factories
    from specdecode.config import SamplingParams
    from specdecode.engine.engine import Engine
    from specdecode.models.loader import load_model

    warmed = []
    real = Engine.warm_up
    monkeypatch.setattr(Engine, "warm_up", lambda self, spec=None: warmed.append(self) or real(self, spec))
    engine = Engine(load_model(tiny_pair[0], dtype="float32"), load_model(tiny_pair[1], dtype="float32"))
    methods = parse_methods("suffix+draft:combine=best", SpecConfig("none"))
    runner_factories(engine, methods, [])["suffix+draft:combine=best"](SamplingParams(max_tokens=8))
    assert len(warmed) == 1
    measure = warmed[0].resources.warm_measures["draft"]
    chooser = warmed[0].drafter(methods[-1].spec).chooser
    assert measure.seconds_per_token > 0
    assert chooser.drafting_seconds("draft", 2) == pytest.approx(2 * measure.seconds_per_token)


def test_methods_take_turns_at_each_slot_across_questions_and_repeats_with_new_runners_each_repeat():
    """Question-major, rotated by one each question and repeat: each method runs first, second ... equally often
    (a machine's drift does not sit on one method's slot), and each method's results stay in question order."""
    from specdecode.bench.datasets import Question
    from specdecode.bench.runner import MethodSpec, TurnOutput
    from specdecode.bench.suite import run_all
    from specdecode.config import SamplingParams

    names = ["none", "draft", "suffix", "auto"]
    methods = [MethodSpec(name, "specdecode", "none") for name in names]
    questions = [Question(str(q), "c", [f"question {q}"]) for q in range(4)]
    calls: list[tuple[str, str]] = []  # (method, question) in the order run
    made: list[str] = []  # the method of each runner made

    def factory(name):
        def run_turn(messages):
            calls.append((name, messages[0]["content"]))
            return TurnOutput("answer", 1, [1])

        def runner(sampling):
            made.append(name)
            return run_turn
        return runner

    raw = run_all(questions, methods, {name: factory(name) for name in names}, SamplingParams(max_tokens=4),
                  repeats=2, cold=set(names))
    assert len(calls) == 2 * 4 * 4  # the cold ones have no warm-up pass
    # A runner of its own each repeat: a kept one (its suffix cache) would recall its answers to the same questions.
    assert sorted(made) == sorted(names * 2)
    slots = {name: [0] * 4 for name in names}
    for start in range(0, len(calls), 4):
        question_calls = calls[start:start + 4]
        assert len({question for _, question in question_calls}) == 1  # one question's methods back to back
        for slot, (name, _) in enumerate(question_calls):
            slots[name][slot] += 1
    assert all(counts == [2, 2, 2, 2] for counts in slots.values())
    assert [name for name, _ in calls[4:8]] == ["draft", "suffix", "auto", "none"]
    for name in names:
        assert [[r.question_id for r in run] for run in raw[name]] == [["0", "1", "2", "3"]] * 2


def test_a_second_repeat_drafts_as_the_first_did_with_nothing_recalled_from_it(tiny_pair):
    """suffix's cache outlives a request: kept across repeats it would hold its own answer to the same question."""
    from specdecode.bench.datasets import Question
    from specdecode.bench.suite import parse_methods, run_all, runner_factories
    from specdecode.config import SamplingParams
    from specdecode.engine.engine import Engine
    from specdecode.models.loader import load_model

    engine = Engine(load_model(tiny_pair[0], dtype="float32"))
    methods = parse_methods("suffix:guard=off", SpecConfig("none"))
    questions = [Question("1", "c", ["say something long"])]
    raw = run_all(questions, methods, runner_factories(engine, methods, []), SamplingParams(max_tokens=48), 2)
    first, second = (run[0].stats for run in raw["suffix:guard=off"])
    assert first.drafted_tokens > 0
    assert (second.drafted_tokens, second.accepted_tokens) == (first.drafted_tokens, first.accepted_tokens)
