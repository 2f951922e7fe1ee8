"""Relaxed acceptance: opt-in, what each rule keeps, and labelled lossy everywhere it shows."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.acceptance.relaxed import Relaxed
from specdecode.acceptance.verify import verify
from specdecode.bench.report import method_label
from specdecode.bench.suite import parse_methods
from specdecode.cli.main import main
from specdecode.drafters.registry import resolve_spec
from specdecode.engine.stats import GenerationStats
from specdecode.errors import SpecDecodeError
from specdecode.server.responses import speculative
from specdecode.spec_types import DraftProposal

ROW = [0.5, 0.3, 0.15, 0.05]  # the target's law at the root: argmax 0, then 1, 2, 3


def logits_for(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows).log()  # [N+1, V]: softmax gives the rows back


def test_rules_parse_and_bad_ones_are_one_line():
    assert Relaxed.parse("typical") == Relaxed("typical", 0.09)
    assert str(Relaxed.parse("threshold:0.5")) == "threshold:0.5"
    for bad in ("medusa", "typical:x", "threshold:0", "threshold:1.5", "typical:nan"):
        with pytest.raises(SpecDecodeError, match="relaxed acceptance"):
            Relaxed.parse(bad)
    assert SpecConfig("ngram").lossless and SpecConfig("ngram").relaxed is None
    spec = resolve_spec(SpecConfig("ngram", relaxed="typical"))
    assert spec.relaxed == "typical:0.09" and not spec.lossless and Relaxed.parse(spec.relaxed) == Relaxed("typical", 0.09)
    with pytest.raises(SpecDecodeError, match="relaxed acceptance"):
        resolve_spec(SpecConfig("ngram", relaxed="medusa"))
    with pytest.raises(SpecDecodeError):
        SpecConfig("ngram", relaxed=3)


def test_what_each_rule_keeps():
    p = torch.tensor([ROW])  # [1, V]
    rows, tokens = torch.zeros(4, dtype=torch.long), torch.arange(4)
    assert Relaxed("threshold", 0.3).keeps(p, rows, tokens).tolist() == [True, True, False, False]
    # Typical: p(x) > min(eps, sqrt(eps) * exp(-H)); here exp(-H) * 0.3 is about 0.096, so the bar is eps.
    entropy = -sum(x * math.log(x) for x in ROW)
    assert 0.3 * math.exp(-entropy) > 0.09
    assert Relaxed("typical", 0.09).keeps(p, rows, tokens).tolist() == [True, True, True, False]
    # An uncertain row lowers the bar below epsilon: flat over 4 tokens, sqrt(0.5) * exp(-ln 4) = 0.18 < 0.5.
    flat = torch.full((1, 4), 0.25)
    assert Relaxed("typical", 0.5).keeps(flat, rows, tokens).tolist() == [True] * 4
    assert Relaxed("threshold", 0.5).keeps(flat, rows, tokens).tolist() == [False] * 4


def test_greedy_and_sampled_verification_keep_what_the_rule_keeps():
    chain = DraftProposal.chain([1, 2])  # neither is the target's argmax
    logits = logits_for(ROW, [0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25])
    greedy = SamplingParams()
    exact = verify(chain, logits, greedy, None)
    assert exact.num_accepted == 0 and exact.tokens == [0]
    relaxed = verify(chain, logits, greedy, None, Relaxed("threshold", 0.3))
    assert relaxed.num_accepted == 2 and relaxed.tokens[:2] == [1, 2]  # token 1 by the rule, token 2 exactly
    strict = verify(chain, logits, greedy, None, Relaxed("threshold", 0.31))
    assert strict.tokens == exact.tokens
    sampled = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    kept = [verify(chain, logits, sampled, generator, Relaxed("threshold", 0.3)).num_accepted for _ in range(20)]
    assert min(kept) >= 1  # token 1 (p 0.3) is always kept, where the exact rule keeps it 30% of the time


def test_labelled_lossy_in_stats_responses_bench_and_check(tmp_path, capsys):
    target = save_tiny_model(tmp_path / "t", "qwen2", scale=0.15)
    from specdecode.models.loader import load_model

    engine = Engine(load_model(target, dtype="float32"))
    prompt, params = "abcabcabcabc", SamplingParams(max_tokens=24, ignore_eos=True)
    exact = engine.complete(prompt, params, SpecConfig("ngram", guard=False))
    loose = engine.complete(prompt, params, SpecConfig("ngram", guard=False, relaxed="threshold:0.01"))
    assert loose.stats.accepted_tokens >= exact.stats.accepted_tokens
    assert exact.stats.to_dict()["lossless"] and exact.stats.to_dict()["acceptance"] == "exact"
    assert loose.stats.to_dict()["acceptance"] == "threshold:0.01" and not loose.stats.to_dict()["lossless"]
    assert speculative(loose.stats)["lossless"] is False
    assert speculative(GenerationStats())["acceptance"] == "exact"
    methods = parse_methods("ngram,ngram:relaxed=typical", SpecConfig())
    assert [m.spec.relaxed for m in methods] == [None, None, "typical:0.09"]
    assert method_label("ngram", {"relaxed": "typical:0.09"}) == "ngram (lossy: typical:0.09)"
    assert method_label("ngram", {"relaxed": None}) == "ngram"
    code = main(["check", "abcabcabc", "--model", str(target), "--dtype", "float32", "--spec-type", "ngram",
                 "--relaxed-acceptance", "threshold:0.9", "--max-tokens", "8", "--trials", "0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and not report["passed"] and report["relaxed"] == "threshold:0.9"
    assert main(["generate", "x", "--model", str(target), "--relaxed-acceptance", "loose"]) == 2
    assert "relaxed acceptance must be one of typical, threshold" in capsys.readouterr().err
