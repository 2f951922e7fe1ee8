"""The drafter contract (test_drafter_contract.py) over a mixture-of-experts target (a tiny Qwen3-MoE), for what
its verify forward changes: rows routed to experts, each expert run once over all of its rows. One drafter of each
kind of verify forward (Qwen3-MoE ships no MTP layers): a chain, a tree, drafts read off the target's hidden states,
a block. Greedy output equals plain decoding in float32; on a w4a8 target it is bitwise plain decoding, alone and
with requests verified together in batches. The draft model is a noisy copy of the target, itself a mixture of
experts. (The whole contract runs over the dense families; a MoE target changes only the verify forward.)"""

from __future__ import annotations

import pytest
from batched_runs import run_batched
from conftest import TINY_VOCAB, save_tiny_model
from test_drafter_contract import CONFIGS, IDS, PROMPTS, drafter_folders, greedy

from specdecode import Engine, SpecConfig
from specdecode.models.families import family_of
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model

# chains from a draft model and from n-grams, a tree from a draft model, a tree off the target's hidden states, a
# block drafted in one pass
CHOSEN = ("draft", "ngram", "draft-tree", "eagle3-tree", "dflash")
RUNS = [pytest.param(method, options, id=name) for (method, options), name in zip(CONFIGS, IDS) if name in CHOSEN]
BATCHED = [run for run in RUNS if run.id in ("draft-tree", "eagle3-tree")]

# These tests compare drafted counts across runs: per-step choice must not read the machine's clock (conftest).
pytestmark = pytest.mark.usefixtures("frozen_choice_clock")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the target, its noisy copy as the draft model, the target's folder, the drafters' folders)."""
    root = tmp_path_factory.mktemp("moe-contract")
    sizes = {"num_hidden_layers": 3, "mlp_only_layers": [1]}
    target = load_model(save_tiny_model(root / "target", "qwen3_moe", scale=0.15, **sizes), dtype="float32")
    draft = load_model(save_tiny_model(root / "draft", "qwen3_moe", scale=0.15, noise=0.01, **sizes),
                       dtype="float32")
    return target, draft, root / "target", drafter_folders(root, target, TINY_VOCAB)


@pytest.mark.parametrize(("method", "options"), RUNS)
def test_greedy_output_equals_plain_decoding(pair, method, options):
    engine = Engine(pair[0], pair[1], draft_path=pair[3])
    target = pair[0].model
    assert target.config.moe is not None and family_of(target.config).batch_invariant(target)
    drafted = accepted = 0
    for prompt in PROMPTS[:2]:
        plain = engine.complete(prompt, greedy(24), SpecConfig("none")).token_ids
        result = engine.complete(prompt, greedy(24), SpecConfig(method, num_draft_tokens=4, options=options))
        assert result.token_ids == plain, f"{method} {options} diverged on {prompt!r}"
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    assert 0 < accepted < drafted  # the check only has teeth if drafts were both accepted and rejected


@pytest.fixture(scope="module")
def w4a8_engine(pair):
    reason = w4a8_unavailable()
    if reason is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {reason}")
    return Engine(load_model(pair[2], dtype="bfloat16", quant="w4a8"), pair[1], draft_path=pair[3])


@pytest.mark.parametrize(("method", "options"), BATCHED)
def test_w4a8_target_output_is_bitwise_plain_decoding_alone_and_batched(w4a8_engine, monkeypatch, method, options):
    for prompt in PROMPTS[:2]:
        plain = w4a8_engine.complete(prompt, greedy(24), SpecConfig("none")).token_ids
        result = w4a8_engine.complete(prompt, greedy(24), SpecConfig(method, num_draft_tokens=4, options=options))
        assert result.token_ids == plain, f"{method} {options} diverged on {prompt!r} in bf16 w4a8"
    monkeypatch.setattr(w4a8_engine.load_budget, "draft_cap", lambda seqs, wanted: max(wanted))
    requests = [(p, greedy(8 + 6 * i), SpecConfig(method, num_draft_tokens=3, options=options))
                for i, p in enumerate(PROMPTS[:2])] + [(PROMPTS[2], greedy(10), SpecConfig("none"))]
    alone = [w4a8_engine.complete(*request).token_ids for request in requests]
    batched, shapes = run_batched(w4a8_engine, requests)
    assert batched == alone
    assert any(batch > 1 and rows > 1 for batch, rows in shapes), "no batch verified a draft"


@pytest.mark.parametrize("precision", ["float32", "w4a8"])
def test_per_step_choice_prices_drafts_by_the_experts_and_keeps_plain_output(pair, request, precision):
    """On a MoE target per-step choice prices a verify forward by the distinct experts its rows read
    (drafters/verify_cost.py) and asks the draft model for the depth that promises most: the output stays plain
    decoding's, and the stats say which depth each chosen member drafted. A drafter alone runs under the choice
    too there (test_verify_cost.py: with the guard off it drafts every step)."""
    engine = (request.getfixturevalue("w4a8_engine") if precision == "w4a8"
              else Engine(pair[0], pair[1], draft_path=pair[3]))
    spec = SpecConfig("ngram,draft", num_draft_tokens=4, combine="best")
    chooser = engine.drafter(spec).chooser
    assert chooser.verify.priced_by_experts and len(chooser.verify.tally.blocks) == 2  # layer 1 is dense
    for prompt in PROMPTS[:2]:
        plain = engine.complete(prompt, greedy(24), SpecConfig("none")).token_ids
        result = engine.complete(prompt, greedy(24), spec)
        assert result.token_ids == plain, f"per-step choice diverged on {prompt!r} ({precision})"
        drafting = [record for name, record in result.stats.choices.items() if name != "plain" and record.drafted]
        assert drafting and all(1 <= record.drafted / record.steps <= 4 for record in drafting)
    assert chooser.verify.experts.seen  # the experts of verify forwards were counted by row count
    alone = engine.drafter(SpecConfig("draft", num_draft_tokens=4))  # one drafter: priced too
    assert alone.chooser is not None and alone.chooser.verify.priced_by_experts
