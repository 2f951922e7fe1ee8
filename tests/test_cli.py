"""The command line as a user meets it: output, JSON shape, exit codes, one-line errors."""

from __future__ import annotations

import json

import pytest
from conftest import save_tiny_model

from specdecode.cli import main


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target = save_tiny_model(root / "target", "qwen2", scale=0.15)
    draft = save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01)
    return str(target), str(draft)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_output_has_text_ids_and_stats(models, capsys):
    target, draft = models
    code, out, _ = run(capsys, "generate", "hello hello hello", "--model", target, "--draft-model", draft,
                       "--max-tokens", "20", "--ignore-eos", "--dtype", "float32", "--json")
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert len(report["token_ids"]) == 20 and report["finish_reason"] == "length"
    stats = report["stats"]
    for key in ("drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
                "accepted_per_position", "target_forwards", "tokens_per_second"):
        assert key in stats
    assert stats["method"] == "ngram,draft"  # a draft model makes the chain the default
    assert 0 <= stats["accepted_tokens"] <= stats["drafted_tokens"]


def test_streams_text_and_reports_stats_and_speedup(models, capsys):
    target, draft = models
    code, out, err = run(capsys, "generate", "abcabc", "--model", target, "--draft-model", draft,
                         "--max-tokens", "12", "--ignore-eos", "--dtype", "float32", "--compare-plain")
    assert code == 0 and out.endswith("\n")
    assert "12 new tokens" in err and "tokens/s" in err
    assert "identical output: True" in err and "speedup" in err


def test_json_compare_plain_reports_identity(models, capsys):
    target, _ = models
    code, out, _ = run(capsys, "generate", "abcabc", "--model", target, "--max-tokens", "10", "--ignore-eos",
                       "--dtype", "float32", "--json", "--compare-plain")
    report = json.loads(out)
    assert code == 0 and report["stats"]["method"] == "ngram" and report["plain"]["identical"] is True


def test_prompt_from_stdin(models, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    code, out, _ = run(capsys, "generate", "-", "--model", models[0], "--max-tokens", "3", "--ignore-eos",
                       "--json", "--raw", "--spec-type", "none")
    assert code == 0 and json.loads(out)["stats"]["prompt_tokens"] == len("from stdin")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--spec-type", "bogus"], "unknown speculative method 'bogus'"),
        (["--spec-type", "draft"], "needs a draft model"),
        (["--num-draft-tokens", "-1"], "num_draft_tokens must be between 0 and 64"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--max-tokens", "0"], "max_tokens must be >= 1"),
        (["--context", "4"], "leaves no room in the context of 4"),
        (["--dtype", "int3"], "unknown dtype 'int3'"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(models, capsys, extra, message):
    argv = ["generate", "some prompt", "--model", models[0], "--dtype", "float32", *extra]
    if "--model" in extra:
        argv = ["generate", "some prompt", *extra]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_models_lists_defaults(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and "qwen2.5-coder-1.5b-instruct" in out and "qwen2.5-coder-0.5b-instruct" in out


def test_auto_draft_quant_is_w4a8_where_it_runs_else_int4(monkeypatch, capsys):
    import argparse

    from specdecode.cli.options import draft_quant
    from specdecode.models.quant import w4a8_linear

    def flags(**overrides):
        return argparse.Namespace(**{"draft_quant": "auto", "device": "cpu", "group_size": 32, **overrides})

    assert draft_quant(flags()) == ("w4a8" if w4a8_linear.w4a8_unavailable() is None else "int4")
    assert draft_quant(flags(group_size=64)) == "int4"
    assert draft_quant(flags(device="cuda")) == "none"
    assert draft_quant(flags(draft_quant="int8")) == "int8"
    monkeypatch.setattr(w4a8_linear, "_kernel", None)  # as in a fresh process on a CPU without AVX2
    monkeypatch.setattr(w4a8_linear, "_cpu_flags", lambda: {"avx", "f16c"})
    assert draft_quant(flags(), quiet=False) == "int4"
    assert "draft in int4, not w4a8: it needs a CPU with" in capsys.readouterr().err
