"""The command line as a user meets it: output, JSON shape, exit codes, one-line errors."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, save_tiny_model

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
    assert stats["method"] == "suffix,draft"  # auto, the default: the draft model given, after the lookups
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
    # auto, the default, finds no drafter for a tiny model of its own vocabulary: the free ones alone
    assert code == 0 and report["stats"]["method"] == "suffix" and report["plain"]["identical"] is True
    memory = report["memory"]  # peaks are monotone by phase; the weights and caches are the model's own
    peaks = memory["peak_rss_bytes"]
    assert 0 < memory["rss_before_load_bytes"] <= peaks["load"] <= peaks["generate"] <= peaks["compare_plain"]
    assert memory["weights_bytes"]["target"] > 0 and memory["cache_bytes"] == report["stats"]["kv_cache_bytes"]
    assert memory["needed_bytes"] == sum(memory["weights_bytes"].values()) + memory["cache_bytes"]


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
        (["--model", ""], "the model name is empty"),
        (["--spec-type", "bogus"], "unknown speculative method 'bogus'"),
        (["--spec-type", "x" * 10_000], "(10000 characters)"),  # echoed cut short, not whole
        (["--spec-type", "ngram,"], "method 'ngram,' has an empty member"),
        (["--spec-type", "none,ngram"], "combines 'none', which drafts nothing; leave it out ('ngram')"),
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


def test_serve_help_shows_the_request_timeouts_default_and_the_prefill_chunks_bound(capsys):
    code, out, _ = run(capsys, "serve", "--help")
    help_text = " ".join(out.split())
    assert code == 0 and "checked between prompt chunks and steps (default 600)" in help_text
    assert "waits at most a round plus one chunk while prompts are read" in help_text


def test_models_lists_defaults(capsys):
    code, out, _ = run(capsys, "models")
    assert code == 0 and "qwen2.5-coder-1.5b-instruct" in out and "qwen2.5-coder-0.5b-instruct" in out


def test_auto_draft_quant_is_w4a8_where_it_runs_else_int4(monkeypatch, capsys):
    """A draft model included: 3 bits decoded no faster end to end on unseen prompts (#62), so auto keeps 4."""
    import argparse

    from specdecode.cli.options import draft_quant
    from specdecode.models.kernels import w4a8_linear

    def flags(**overrides):
        return argparse.Namespace(**{"draft_quant": "auto", "device": "cpu", "group_size": 32, **overrides})

    runs = w4a8_linear.w4a8_unavailable() is None
    assert draft_quant(flags()) == ("w4a8" if runs else "int4")
    assert draft_quant(flags(group_size=64)) == "int4"
    assert draft_quant(flags(device="cuda")) == "none"
    assert draft_quant(flags(draft_quant="int8")) == "int8"
    assert draft_quant(flags(draft_quant="w3a8")) == "w3a8"  # asked for by name: as asked
    monkeypatch.setattr(w4a8_linear, "_kernel", None)  # as in a fresh process on a CPU without AVX2
    monkeypatch.setattr(w4a8_linear, "cpu_flags", lambda: {"avx", "f16c"})
    assert draft_quant(flags(), quiet=False) == "int4"
    assert "draft in int4, not w4a8: it needs a CPU with" in capsys.readouterr().err


def assert_one_error_line(code: int, err: str, message: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and message in err and "Traceback" not in err, err
    assert err.count("\n") == 1, err


def broken_copy(folder: str, tmp_path, edit) -> str:
    import shutil
    from pathlib import Path

    copy = tmp_path / "broken"
    shutil.copytree(folder, copy)
    edit(Path(copy))
    return str(copy)


@pytest.mark.parametrize(("argv", "message"), [
    (["generate"], "the following arguments are required: prompt"),
    (["generate", "x", "--max-tokens", "many"], "invalid int value: 'many'"),
    (["telepathy"], "invalid choice: 'telepathy'"),
    (["generate", "a\udcffb"], "command-line argument 2 is not UTF-8 text"),
    (["generate", "x", "--stop", "\udcfe"], "command-line argument 4 is not UTF-8 text"),
    (["generate", "x", "--device", "tpu"], "unknown device 'tpu'"),
    (["generate", "x", "--context", "0"], "--context must be >= 1"),
])
def test_parser_and_early_checks_answer_in_one_line(models, capsys, monkeypatch, argv, message):
    from specdecode.models import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model loaded before the check"))
    code, _, err = run(capsys, *argv, *(["--model", models[0]] if len(argv) > 1 else []))
    assert_one_error_line(code, err, message)


def test_an_empty_prompt_is_refused_from_stdin_and_the_command_line_alike(models, capsys, monkeypatch):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # what `specdecode generate - < /dev/null` reads
    code, _, err = run(capsys, "generate", "-", "--model", models[0], "--dtype", "float32")
    assert_one_error_line(code, err, "the prompt is empty (nothing on standard input)")
    code, _, err = run(capsys, "generate", "", "--model", models[0], "--dtype", "float32")
    assert_one_error_line(code, err, "the prompt is empty")


def test_an_option_of_a_method_not_run_is_refused(models, capsys):
    code, _, err = run(capsys, "generate", "hi", "--model", models[0], "--spec-type", "ngram",
                       "--draft-tree-nodes", "8")
    assert_one_error_line(code, err, "option draft_tree_nodes belongs to method 'draft', which 'ngram' does not run")


def test_invalid_utf8_on_stdin_is_one_line(models, capsys, monkeypatch):
    import io

    # What `printf '\xff\xfe bad' | specdecode generate -` reads: Python maps the bad bytes to lone surrogates.
    monkeypatch.setattr("sys.stdin", io.StringIO(b"\xff\xfe bad".decode("utf-8", "surrogateescape")))
    code, _, err = run(capsys, "generate", "-", "--model", models[0], "--dtype", "float32")
    assert_one_error_line(code, err, "the prompt on standard input is not valid Unicode text")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f: (f / "config.json").write_text(
        (f / "config.json").read_text().replace('"intermediate_size": 128', '"intermediate_size": 96')),
     "config.json does not belong to these weights"),
    (lambda f: [(f / name).unlink() for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")],
     "has no tokenizer"),
])
def test_broken_model_folders_are_one_line(models, capsys, tmp_path, edit, message):
    folder = broken_copy(models[0], tmp_path, edit)
    code, _, err = run(capsys, "generate", "hi", "--model", folder, "--dtype", "float32")
    assert_one_error_line(code, err, message)


@pytest.mark.parametrize(("extra", "message"), [
    (["--max-active", "0"], "--max-active must be >= 1"), (["--request-timeout", "nan"], "--request-timeout must"),
    (["--log-level", "loud"], "unknown --log-level 'loud'"), (["--public-routes", "admin"], "unknown route group"),
    (["--port", "70000"], "--port must be between 0 and 65535"), (["--spec-type", "telepathy"], "unknown speculative"),
    (["--prefill-chunk", "0"], "--prefill-chunk: auto or a number of tokens of at least 1, not '0'"),
    (["--prefix-cache", "lots"], "not a size: 'lots'"),
])
def test_serve_checks_its_flags_before_loading(models, capsys, monkeypatch, extra, message):
    from specdecode.models import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model loaded before the check"))
    code, _, err = run(capsys, "serve", "--model", models[0], "--port", "0", *extra)
    assert_one_error_line(code, err, message)


def test_port_in_use_fails_before_loading_the_models(models, capsys, monkeypatch):
    import socket

    from specdecode.models import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("a model loaded before the port check"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, _, err = run(capsys, "serve", "--model", models[0], "--port", str(taken.getsockname()[1]))
    assert_one_error_line(code, err, "cannot listen on 127.0.0.1:")


@pytest.mark.parametrize("delay", [0.3, 0.8, 1.5])
def test_ctrl_c_during_start_up_prints_no_traceback(models, delay):
    import os
    import signal
    import subprocess
    import sys
    import time

    # What the installed `specdecode` script runs; the imports of torch and the models take over a second.
    script = "import sys; from specdecode.cli.main import main; sys.exit(main())"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-c", script, "generate", "hi", "--model", models[0], "--max-tokens",
                                "2000", "--ignore-eos", "--quiet"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, env=env, text=True)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err.strip() == "interrupted", err
