"""The batch's draft budget (engine/load_budget.py) on scripted costs: how many tokens a batch drafts, what it
tries, probes and learns, and how a drafter's catch-up is priced."""

from __future__ import annotations

import pytest

from specdecode import SamplingParams, SpecConfig
from specdecode.drafters.capabilities import DeferredStart
from specdecode.engine.load_budget import CATCH_UP_TOKENS, PROBE_EVERY, BatchDraftBudget


class Behind(DeferredStart):
    """A drafter whose proposals are chains of the budget's length and which has `seq.behind` committed tokens
    to read before it can propose."""

    def defer_start(self, seq) -> None:
        seq.behind = len(seq.tokens)

    def pending_tokens(self, seq) -> int:
        return seq.behind


class Scripted:
    """A sequence as the budget sees it: its method, its token budget, and a drafter whose proposals are chains
    and which has `behind` committed tokens to read before it can propose."""

    def __init__(self, method: str = "scripted", behind: int = 0):
        self.spec = SpecConfig(method)
        self.sampling, self.generated = SamplingParams(max_tokens=128), 0
        self.behind = behind
        self.drafter = Behind()


def trained_budget(forward_seconds: dict[int, float], acceptance: float, seqs: list, draft_seconds: float = 0.0):
    budget = BatchDraftBudget()
    budget.forward_seconds.update(forward_seconds)
    for seq in seqs:  # 100 steps of 4 drafted tokens each, accepted at `acceptance` per position
        for _ in range(100):
            budget.observe_sequence(seq, 4, 0, draft_seconds)
            budget.end_step()
        for estimate in (budget._estimate(seq), budget._method(seq)):
            estimate.accepted, estimate.tried = acceptance * 100, 100.0
    return budget


def test_budget_drafts_fully_while_rows_are_nearly_free_and_stops_where_the_target_is_compute_bound():
    seqs = [Scripted() for _ in range(4)]
    memory_bound = {rows: 0.030 + 0.0002 * rows for rows in (4, 8, 12, 16, 20)}  # weights' stream dominates
    assert trained_budget(memory_bound, 0.7, seqs).draft_cap(seqs, [4] * 4) == 4
    compute_bound = {rows: 0.010 * rows for rows in (4, 8, 12, 16, 20)}  # every row costs as much as a step
    assert trained_budget(compute_bound, 0.7, seqs).draft_cap(seqs, [4] * 4) == 0
    # In between, the length where one more token's acceptance stops paying for its rows.
    rising = {rows: 0.030 + 0.004 * rows for rows in (4, 8, 12, 16, 20)}
    assert trained_budget(rising, 0.6, seqs).draft_cap(seqs, [4] * 4) == 1
    assert trained_budget(rising, 0.95, seqs).draft_cap(seqs, [4] * 4) == 4
    # Drafting's own cost counts: a draft model at 50 ms a token does not pay even with free rows; new requests
    # of the method start from that cost (they once looked free, and a batch of them drafted in full).
    dear = trained_budget(memory_bound, 0.7, seqs, draft_seconds=4 * 0.05)
    assert dear.draft_cap(seqs, [4] * 4) == 0
    assert dear.draft_cap([Scripted() for _ in range(4)], [4] * 4) == 0
    # Never more than a sequence asks for.
    assert trained_budget(memory_bound, 0.7, seqs).draft_cap(seqs, [2, 1, 0, 2]) == 2


def test_budget_tries_what_it_has_not_measured_then_settles_on_what_pays():
    seqs = [Scripted() for _ in range(4)]
    budget = BatchDraftBudget()
    cost = {rows: 0.010 * rows for rows in range(1, 21)}  # compute-bound: drafts never pay at acceptance 1/2
    chosen = []
    for _ in range(6):
        k = budget.draft_cap(seqs, [4] * 4)
        chosen.append(k)
        budget.observe_forward(4 * (1 + k), cost[4 * (1 + k)])
    assert chosen[:2] == [0, 4] and chosen[2:] == [0, 0, 0, 0]


def test_budget_probes_while_plain_batching_wins_and_learns_from_every_step():
    seqs = [Scripted() for _ in range(4)]
    close_call = {rows: 0.014 + 0.010 * rows for rows in (4, 8, 12, 16, 20)}  # drafting one token nearly pays
    budget = trained_budget(close_call, 0.5, seqs)
    chosen = [budget.draft_cap(seqs, [4] * 4) for _ in range(2 * PROBE_EVERY)]
    assert chosen.count(0) == 2 * PROBE_EVERY - 2 and chosen[PROBE_EVERY - 1] > 0 and chosen[-1] > 0
    far_behind = trained_budget({rows: 0.010 * rows for rows in (4, 8, 12, 16, 20)}, 0.5, seqs)
    assert {far_behind.draft_cap(seqs, [4] * 4) for _ in range(2 * PROBE_EVERY)} == {0}  # no dear probes
    # No probe where a drafter would first catch up, even one never priced: it serves nothing while plain wins.
    behind = [Scripted("unpriced", behind=CATCH_UP_TOKENS + 1) for _ in range(4)]
    behind_budget = trained_budget(close_call, 0.5, behind)
    assert {behind_budget.draft_cap(behind, [4] * 4) for _ in range(2 * PROBE_EVERY)} == {0}
    for seq in behind:
        seq.behind = CATCH_UP_TOKENS
    assert behind_budget.draft_cap(behind, [4] * 4) > 0  # within reach: probed (its turn has long come)
    # A request alone drafts and is accepted often: its method's next requests start from that.
    learner = Scripted("often-right")
    for _ in range(50):
        budget.observe_sequence(learner, 4, 4, 0.0)
    newcomer = Scripted("often-right")
    assert budget._estimate(newcomer).acceptance > 0.9 and budget._estimate(Scripted()).acceptance < 0.6


def test_a_catch_up_is_learnt_apart_and_charged_once_measured():
    seqs = [Scripted("behind", behind=100) for _ in range(4)]  # e.g. a draft model that started under load
    memory_bound = {rows: 0.030 + 0.0002 * rows for rows in (4, 8, 12, 16, 20)}
    budget = trained_budget(memory_bound, 0.7, seqs, draft_seconds=4 * 0.0002)
    assert budget.draft_cap(seqs, [4] * 4) == 4  # no catch-up measured yet: tried
    for seq in seqs[:3]:  # three caught up: 100 tokens behind, 4 committed, 1 left to read
        seq.behind = 1
    for seq in seqs:  # 4 s of drafting in all, shared among the four as the engine shares a drafter's time
        budget.observe_sequence(seq, 4, 3, 1.0)
    budget.end_step()
    usual = 4 * 4 * 0.0002
    assert budget._method(seqs[0]).catch_up_seconds_per_token == pytest.approx((4.0 - usual) / (3 * 103))
    assert budget._estimate(seqs[3]).draft_seconds_per_token == pytest.approx(0.0002)  # not its share of 1 s
    # Charged (k + 1) / 128 of 1 s each, drafting no longer pays, and no probe pays it either.
    for seq in seqs:
        seq.behind = 100
    assert {budget.draft_cap(seqs, [4] * 4) for _ in range(2 * PROBE_EVERY)} == {0}
    for seq in seqs:  # caught up (within CATCH_UP_TOKENS): the rows are nearly free again
        seq.behind = 1
    assert budget.draft_cap(seqs, [4] * 4) == 4
    # Behind again, but with far more of the request left to draft for: its share of the catch-up is small.
    for seq in seqs:
        seq.behind, seq.sampling = 100, SamplingParams(max_tokens=4096)
    assert budget.draft_cap(seqs, [4] * 4) == 4


def test_a_catch_up_never_measured_is_priced_at_the_targets_prefill():
    # `auto`: the draft model reads a 150-token prompt when it is first chosen, and no catch-up was timed yet.
    seqs = [Scripted("deferred", behind=150) for _ in range(4)]
    memory_bound = {rows: 0.030 + 0.0002 * rows for rows in (4, 8, 12, 16, 20)}
    budget = trained_budget(memory_bound, 0.7, seqs, draft_seconds=4 * 0.0002)
    budget.observe_prefill(CATCH_UP_TOKENS, 10.0)  # a short prompt prices nothing: its forward's fixed costs
    assert budget.draft_cap(seqs, [4] * 4) == 4  # nothing known: tried
    budget.observe_prefill(150, 150 * 0.008)  # the target reads 8 ms a token: 5/128 of 1.2 s each, too dear
    assert {budget.draft_cap(seqs, [4] * 4) for _ in range(2 * PROBE_EVERY)} == {0}
    budget.observe_prefill(150, 150 * 0.0001)  # a cheaper prompt: smoothed, 6.4 ms a token, still too dear
    assert budget.draft_cap(seqs, [4] * 4) == 0
    budget._method(seqs[0]).catch_up_seconds_per_token = 0.0005  # once measured, the measurement decides
    assert budget.draft_cap(seqs, [4] * 4) == 4


def test_forward_estimates_interpolate_and_extrapolate_on_the_measured_slope():
    budget = BatchDraftBudget()
    assert budget.forward_estimate(8) == 0.0  # nothing measured: every choice looks free, so one gets tried
    budget.observe_forward(4, 0.040)
    assert budget.forward_estimate(16) == 0.040 and budget.forward_estimate(2) == 0.020  # hopeful both ways
    budget.observe_forward(8, 0.080)
    assert budget.forward_estimate(6) == pytest.approx(0.060)
    assert budget.forward_estimate(16) == pytest.approx(0.160)  # rows proposals never fill are not free
