"""The speed guard on scripted costs: it leaves a drafter that pays alone, shrinks and then pauses one that
does not, probes again later, and never changes greedy output."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import FakeClock

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.engine.forward import forward_rows
from specdecode.engine.speed_guard import FIRST_PAUSE, MAX_PAUSE, WINDOW, PlainStepClock, SpeedGuard

PLAIN_SECONDS = 1.0


def run(guard: SpeedGuard, steps: int, draft_cost: float, accepted_of: Callable[[int], int], wanted: int = 4) -> dict:
    """Script `steps` steps: a step drafting k tokens costs PLAIN_SECONDS + draft_cost * k and commits
    1 + accepted_of(k); a step without drafts costs PLAIN_SECONDS and commits one. -> totals and budgets."""
    seconds = tokens = 0.0
    budgets = []
    for _ in range(steps):
        k, _reason = guard.budget(wanted)
        cost, committed = PLAIN_SECONDS + draft_cost * k, 1 + (accepted_of(k) if k else 0)
        guard.observe(cost, committed, k)
        seconds, tokens = seconds + cost, tokens + committed
        budgets.append(k)
    return {"rate": tokens / seconds, "budgets": budgets}


def test_a_drafter_that_pays_is_left_alone():
    guard = SpeedGuard(PlainStepClock(), enabled=True)
    result = run(guard, 400, draft_cost=0.1, accepted_of=lambda k: k // 2)
    # One plain step to time the clock, every other step drafts all it asked for.
    assert result["budgets"].count(0) == 1 and set(result["budgets"]) == {0, 4}
    assert guard.shrinks == guard.pauses == 0 and result["rate"] > 1.5 / PLAIN_SECONDS


@pytest.mark.parametrize("flagged", [False, True])
def test_a_deferred_drafters_catch_up_is_left_out_of_the_windows(flagged):
    """A drafter that pays, whose 3rd drafting step first reads a long context (20 plain steps' time, a draft model
    deferred under per-step choice): flagged as a catch-up, the guard leaves it alone; counted, it shrank the draft."""
    guard = SpeedGuard(PlainStepClock(), enabled=True)
    run(guard, 3, draft_cost=0.1, accepted_of=lambda k: k // 2)  # the first is the start's, left out
    k, _reason = guard.budget(4)
    guard.observe(PLAIN_SECONDS + 0.1 * k + 20.0, 1 + k // 2, k, 0.1 * k + 20.0, caught_up=flagged)
    result = run(guard, 40, draft_cost=0.1, accepted_of=lambda k: k // 2)
    budgets = result["budgets"]
    assert budgets.count(0) == 1  # the plain step that times the clock, after a window of drafting steps
    assert (guard.shrinks == 0 and set(budgets) == {0, 4}) is flagged


def test_a_losing_drafter_is_shrunk_then_paused_with_doubling_pauses():
    guard = SpeedGuard(PlainStepClock(), enabled=True)
    result = run(guard, 2000, draft_cost=0.4, accepted_of=lambda k: 0)  # every draft rejected
    budgets = result["budgets"]
    assert guard.shrinks >= 2 and guard.pauses >= 3
    assert 4 in budgets and 2 in budgets and 1 in budgets  # halved twice before pausing
    assert guard.next_pause == MAX_PAUSE  # every probe failed, so pauses grew to the bound
    # Never slower than plain, give or take the probes: within 5% of plain's one token per plain step.
    assert result["rate"] > 0.95 / PLAIN_SECONDS
    drafting = sum(k > 0 for k in budgets)
    assert drafting < 0.1 * len(budgets)


def test_a_drafter_that_starts_paying_is_taken_back():
    clock = PlainStepClock()
    guard = SpeedGuard(clock, enabled=True)
    run(guard, 300, draft_cost=0.4, accepted_of=lambda k: 0)
    assert guard.pauses >= 1
    # The text turns repetitive: drafts are accepted. After the current pause a probe passes.
    result = run(guard, 600, draft_cost=0.1, accepted_of=lambda k: k)
    assert result["budgets"][-1] >= 2 and guard.next_pause == FIRST_PAUSE
    assert result["budgets"][-WINDOW:].count(0) == 0


def test_the_plain_time_is_learnt_once_per_engine():
    clock = PlainStepClock()
    first = SpeedGuard(clock, enabled=True)
    run(first, WINDOW + 2, draft_cost=0.1, accepted_of=lambda k: k)
    assert clock.seconds == pytest.approx(PLAIN_SECONDS)
    second = SpeedGuard(clock, enabled=True)
    assert all(reason is None for reason in (second.budget(4)[1] for _ in range(3 * WINDOW)))


def test_a_disabled_guard_changes_nothing():
    guard = SpeedGuard(PlainStepClock(), enabled=False)
    result = run(guard, 300, draft_cost=0.4, accepted_of=lambda k: 0)
    assert set(result["budgets"]) == {4} and guard.shrinks == guard.pauses == 0


@pytest.fixture(scope="module")
def engine(noisy_pair):
    return Engine(*noisy_pair)


@pytest.mark.parametrize("method", ["ngram", "draft", "ngram,draft"])
def test_a_slow_drafter_is_paused_in_the_engine_and_output_is_unchanged(engine, monkeypatch, method):
    """The engine's clock is scripted: a target forward takes 1 s, any drafting 5 s, so drafts never pay."""
    clock = FakeClock()
    monkeypatch.setattr("specdecode.engine.engine.perf_counter", clock)
    monkeypatch.setattr("specdecode.engine.request.perf_counter", clock)  # the request's total time
    forward = forward_rows

    def timed_forward(model, seq, inputs, logits_at=None):
        clock.now += 1.0
        return forward(model, seq, inputs, logits_at)

    monkeypatch.setattr("specdecode.engine.forward.forward_rows", timed_forward)  # verify forwards
    monkeypatch.setattr("specdecode.engine.prefill.forward_rows", timed_forward)  # the prompt's
    sampling = SamplingParams(max_tokens=120, ignore_eos=True)
    prompt = "1 2 3 1 2 3 1 2"
    plain = engine.complete(prompt, sampling, SpecConfig("none"))
    drafter = engine.drafter(SpecConfig(method))
    propose = drafter.propose

    def slow_propose(seq, budget):
        proposal = propose(seq, budget)
        clock.now += 5.0 * bool(proposal.size)
        return proposal

    monkeypatch.setattr(drafter, "propose", slow_propose)
    guarded = engine.complete(prompt, sampling, SpecConfig(method))
    unguarded = engine.complete(prompt, sampling, SpecConfig(method, guard=False))
    assert guarded.token_ids == unguarded.token_ids == plain.token_ids
    stats = guarded.stats
    assert stats.guard_pauses >= 1 and stats.steps_without_draft["guard_paused"] >= FIRST_PAUSE
    assert stats.target_forwards - stats.drafting_steps == sum(stats.steps_without_draft.values())
    assert stats.total_seconds < unguarded.stats.total_seconds
    assert unguarded.stats.guard_pauses == 0 and "guard_paused" not in unguarded.stats.steps_without_draft
    assert plain.stats.steps_without_draft == {}  # plain decoding has nothing to explain


def test_bench_methods_set_the_guard_per_method():
    from specdecode.bench.suite import parse_methods

    specs = {s.name: s.spec for s in parse_methods("draft,draft:guard=off;k=5", SpecConfig("none"))}
    assert specs["draft"].guard and not specs["draft:guard=off;k=5"].guard
    assert specs["draft:guard=off;k=5"].num_draft_tokens == 5
    off = SpecConfig("none", guard=False)
    assert not parse_methods("ngram", off)[1].spec.guard and parse_methods("ngram:guard=on", off)[1].spec.guard


def test_a_drafter_that_costs_time_and_proposes_nothing_is_paused():
    """Asked for drafts, it spends `draft_cost` and proposes none: every step verifies nothing, so each is a
    plain step to the clock, but only its forward is: the guard sees the drafting time and pauses it."""
    clock = PlainStepClock()
    guard = SpeedGuard(clock, enabled=True)
    draft_cost, seconds, tokens = 0.5, 0.0, 0
    for _ in range(1000):
        k, _reason = guard.budget(4)
        spent = draft_cost if k else 0.0
        guard.observe(PLAIN_SECONDS + spent, 1, 0, drafting_seconds=spent)
        seconds, tokens = seconds + PLAIN_SECONDS + spent, tokens + 1
    assert clock.seconds == pytest.approx(PLAIN_SECONDS)
    assert guard.pauses >= 3 and tokens / seconds > 0.9 / PLAIN_SECONDS
