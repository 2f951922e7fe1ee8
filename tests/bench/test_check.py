"""`specdecode check`: a verdict with numbers that passes a lossless configuration and catches a broken
acceptance rule, greedy, coupled or sampled."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from conftest import save_tiny_model

from specdecode.acceptance.chi_square import chi_square
from specdecode.cli.main import main
from specdecode.spec_types import VerifyResult

verify_module = importlib.import_module("specdecode.acceptance.verify")  # the package exports a function of that name
block_module = importlib.import_module("specdecode.acceptance.block_verify")
PROMPTS = ["hello hello hello", "abcabcabc abcabc", "The quick brown fox"]  # the tiny model's drafts miss on some


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("check")
    target = save_tiny_model(root / "target", "qwen2", scale=0.15)
    # Another seed: a draft whose law is far from the target's, so accepting its tokens unchecked shows.
    draft = save_tiny_model(root / "draft", "qwen2", seed=1, scale=0.15)
    return str(target), str(draft)


def run_check(models, capsys, method: str, trials: int, extra: tuple[str, ...] = ()) -> tuple[int, dict]:
    target, draft = models
    code = main(["check", *PROMPTS, "--model", target, "--draft-model", draft, "--draft-quant", "none",
                 "--dtype", "float32", "--spec-type", method, "--max-tokens", "32", "--trials", str(trials),
                 "--temperature", "1.0", "--top-k", "3", "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_lossless_configuration_passes_with_its_numbers(models, capsys, method):
    code, report = run_check(models, capsys, method, trials=300)
    assert code == 0 and report["passed"]
    assert all(case["first_difference"] is None and case["drafted"] > 0 for case in report["greedy"])
    assert any(case["accepted"] < case["drafted"] for case in report["greedy"])  # rejections were checked too
    assert all(case["first_difference"] is None for case in report["sampled_identity"])
    assert sum(case["drafted"] for case in report["sampled_identity"]) > 0
    assert report["verification"] == "block"  # the distribution test judged the rule unseeded requests run
    sampled = report["sampling"]
    assert sampled["drafted"] > 0 and sampled["tested"] > 50 and sampled["statistic"] < sampled["critical"]


def test_a_greedy_rule_that_accepts_every_draft_is_caught(models, capsys, monkeypatch):
    def accept_all(proposal, children, target_logits, relaxed_keeps=None):
        tokens, path, row = proposal.tokens.tolist(), [], 0
        while children[row]:
            path.append(children[row][0])
            row = path[-1] + 1
        return VerifyResult(path, [tokens[i] for i in path] + [int(target_logits[row].argmax())], proposal.source)

    monkeypatch.setattr(verify_module, "greedy_walk", accept_all)
    code, report = run_check(models, capsys, "ngram", trials=0)
    assert code == 1 and not report["passed"]
    assert any(case["first_difference"] is not None for case in report["greedy"])
    # Where it differs, plain decoding's margin there says whether rounding could explain it (here it cannot:
    # a float32 target's forward on the CPU is batch-invariant, and the rule accepted wrong tokens).
    assert report["batch_invariant"] is True
    for case in report["greedy"]:
        assert (case["logit_gap"] is None) == (case["first_difference"] is None or
                                                case["first_difference"] >= case["tokens"])
        assert case["logit_gap"] is None or case["logit_gap"] >= 0


def test_a_coupled_rule_that_accepts_every_draft_is_caught(models, capsys, monkeypatch):
    def accept_all(proposal, children, p, noise, relaxed_keeps=None):
        tokens, path, row = proposal.tokens.tolist(), [], 0
        while children[row]:
            path.append(children[row][0])
            row = path[-1] + 1
        return VerifyResult(path, [tokens[i] for i in path] + [int((p[row] * noise[row]).argmax())], proposal.source)

    monkeypatch.setattr(verify_module, "coupled_walk", accept_all)
    code, report = run_check(models, capsys, "draft", trials=0)
    assert code == 1 and not report["passed"]
    assert all(case["first_difference"] is None for case in report["greedy"])  # greedy rule left alone
    assert any(case["first_difference"] is not None for case in report["sampled_identity"])
    assert all(case["logit_gap"] is None or case["logit_gap"] >= 0 for case in report["sampled_identity"])


@pytest.mark.parametrize("rule", ["block", "token"])
def test_a_sampling_rule_that_accepts_every_draft_is_caught(models, capsys, monkeypatch, rule):
    if rule == "token":
        monkeypatch.setattr(verify_module, "_drawn_siblings", lambda siblings, *rest: (siblings[0], None))
    else:  # the whole block kept, the bonus drawn from the last row
        monkeypatch.setattr(block_module, "block_decision", lambda proposal, p, eta: (proposal.size, p[proposal.size]))
    code, report = run_check(models, capsys, "draft", trials=300, extra=("--verification", rule))
    assert code == 1
    assert all(case["first_difference"] is None for case in report["greedy"])  # greedy rule left alone
    assert "sampled_identity" not in report  # not promised under this rule
    assert report["sampling"]["drafted"] >= 300 and not report["sampling"]["passed"]


def test_usage_errors_are_one_line(models, capsys):
    assert main(["check", "--model", models[0], "--spec-type", "none"]) == 2
    assert main(["check", "--model", models[0], "--temperature", "0"]) == 2
    assert capsys.readouterr().err.count("error:") == 2


def test_chi_square_pools_small_cells_and_rejects_impossible_draws():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    fair = chi_square(torch.tensor([50.0, 30.0, 20.0, 0.0]), probs, alpha=1e-3)
    assert fair.passed and fair.statistic == pytest.approx(0.0)
    assert not chi_square(torch.tensor([90.0, 5.0, 5.0, 0.0]), probs, alpha=1e-3).passed
    impossible = chi_square(torch.tensor([50.0, 30.0, 19.0, 1.0]), probs, alpha=1e-3)
    assert impossible.impossible == 1 and not impossible.passed
