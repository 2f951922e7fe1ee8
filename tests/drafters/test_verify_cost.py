"""Verify forwards priced by the distinct experts they read (drafters/verify_cost.py), and per-step choice's draft
depth on a mixture-of-experts target, on a scripted clock: exact arithmetic, no timing."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from conftest import FakeClock
from scripted_choice import Scripted

from specdecode.drafters.combination import CombinationDrafter
from specdecode.drafters.step_choice import StepChooser
from specdecode.drafters.verify_cost import ExpertsByRows, LineFit, VerifyCost, uniform_touched
from specdecode.spec_types import VerifyResult

EXPERTS, PER_TOKEN = 128, 8  # Qwen3-30B-A3B's and GLM-4.5-Air's routing
FIXED_SECONDS, SECONDS_PER_EXPERT = 0.02, 0.001  # a scripted forward: attention and head, then each expert read


class ScriptedTally:
    """What a MoE target's ExpertTally reports: the distinct experts per layer of the last forward, set by hand."""

    num_experts, experts_per_token = EXPERTS, PER_TOKEN

    def __init__(self):
        self.touched = 0.0

    def last(self) -> float:
        return self.touched


def test_a_line_fits_exactly_on_points_of_a_line():
    line, proportional = LineFit(), LineFit(proportional=True)
    assert line.predict(3) == 0.0  # nothing seen yet
    line.observe(2, 0.5)
    proportional.observe(2, 0.5)
    assert line.predict(10) == pytest.approx(0.5)  # one x: no slope yet, every size costs what was seen
    assert proportional.predict(10) == pytest.approx(2.5)  # or costs it in proportion (experts read)
    line = LineFit()
    for x in (1, 4, 9, 16):
        line.observe(x, 0.1 + 0.05 * x)
    assert line.predict(30) == pytest.approx(0.1 + 0.05 * 30, rel=1e-6)


def test_a_dense_line_never_prices_a_step_below_what_the_cheapest_nodes_cost():
    line, proportional = LineFit(), LineFit(proportional=True)
    # bf16 timings of one request (#62): 1-4 nodes cost 120-160 ms, one 6-node forward 250 ms: a steep noisy slope
    timings = ((3, 0.123), (1, 0.150), (4, 0.118), (2, 0.131), (1, 0.158), (3, 0.121), (6, 0.250), (5, 0.240))
    for x, seconds in timings:
        line.observe(x, seconds)
        proportional.observe(x, seconds)
    cheapest = min(line.by_x.values())  # the running mean of the cheapest node count (4 nodes: 118 ms)
    assert cheapest == pytest.approx(0.118)
    assert line.predict(0) == pytest.approx(cheapest)  # the line alone would put a plain step far below
    assert proportional.predict(0) < cheapest - 0.02  # experts read: the line goes on down, as the experts do
    assert line.predict(6) > line.predict(3) > cheapest  # where the line is above the floor it is the line
    line.observe(0, 0.100)  # a plain step timed: the floor follows it
    assert line.predict(0) == pytest.approx(0.100)


def test_experts_by_rows_start_from_uniform_routing_and_learn_the_model():
    assert uniform_touched(EXPERTS, PER_TOKEN, 1) == pytest.approx(PER_TOKEN)
    assert uniform_touched(EXPERTS, PER_TOKEN, 8) == pytest.approx(51.6, abs=0.1)  # of 64 routed slots
    experts = ExpertsByRows(EXPERTS, PER_TOKEN)
    assert experts.predict(8) == pytest.approx(uniform_touched(EXPERTS, PER_TOKEN, 8))
    for _ in range(40):  # a trained router: neighbouring rows share experts, 70% of uniform routing's count
        for rows in (1, 3):
            experts.observe(rows, 0.7 * uniform_touched(EXPERTS, PER_TOKEN, rows) if rows > 1 else PER_TOKEN)
    assert experts.predict(3) == pytest.approx(0.7 * uniform_touched(EXPERTS, PER_TOKEN, 3))  # seen: as counted
    assert experts.predict(6) < 0.9 * uniform_touched(EXPERTS, PER_TOKEN, 6)  # unseen: scaled like the seen ones
    assert experts.predict(10_000) <= EXPERTS  # never more than there are


def test_a_dense_target_prices_nodes_and_a_moe_target_prices_experts():
    dense = VerifyCost()
    for nodes in (0, 2, 4, 8):
        dense.observe(nodes, 0.1 + 0.002 * nodes)
    assert not dense.priced_by_experts and dense.predict(6) == pytest.approx(0.112, rel=1e-6)
    tally = ScriptedTally()
    moe = VerifyCost(tally)
    for nodes in (0, 1, 3, 7):
        tally.touched = uniform_touched(EXPERTS, PER_TOKEN, nodes + 1)
        moe.observe(nodes, FIXED_SECONDS + SECONDS_PER_EXPERT * tally.touched)
    assert moe.priced_by_experts
    for nodes in (0, 5, 7):  # concave in the rows, as the experts read are: no line in the nodes would fit
        expected = FIXED_SECONDS + SECONDS_PER_EXPERT * uniform_touched(EXPERTS, PER_TOKEN, nodes + 1)
        assert moe.predict(nodes) == pytest.approx(expected, rel=1e-6)


def simulate(chain: CombinationDrafter, clock: FakeClock, tally: ScriptedTally | None, steps: int,
             acceptance: float, budget: int = 8, seed: int = 0, guard: bool = True) -> dict:
    """Script a request on a MoE target whose verify forward costs FIXED_SECONDS plus SECONDS_PER_EXPERT for each
    distinct expert its rows read (uniform routing) -> tokens per second and the mean depth drafted."""
    rng = random.Random(seed)
    seq = SimpleNamespace(drafter_state={}, choices={}, tokens=[0] * 64,
                          sampling=SimpleNamespace(max_tokens=10 * steps), generated=0,
                          spec=SimpleNamespace(num_draft_tokens=budget, adaptive=False, guard=guard))
    chain.start(seq, None)
    began, committed, drafted = clock.now, 0, 0
    for _ in range(steps):
        proposal = chain.propose(seq, budget)
        touched = uniform_touched(EXPERTS, PER_TOKEN, proposal.size + 1)
        if tally is not None:
            tally.touched = touched
        clock.now += FIXED_SECONDS + SECONDS_PER_EXPERT * touched
        accepted = 0
        while accepted < proposal.size and rng.random() < acceptance:
            accepted += 1
        chain.commit(seq, VerifyResult(list(range(accepted)), [1] * (accepted + 1), proposal.source), None)
        committed += accepted + 1
        drafted += proposal.size
        seq.tokens += [1] * (accepted + 1)
        seq.generated += accepted + 1
    return {"rate": committed / (clock.now - began), "depth": drafted / steps, "choices": seq.choices}


def moe_chain(acceptance: float, priced: bool) -> tuple[CombinationDrafter, FakeClock, ScriptedTally | None]:
    """A MoE target's MTP drafter under per-step choice priced by experts, or (priced False) drafting the whole
    budget every step, as a drafter alone or llama.cpp's first-wins rule does."""
    clock = FakeClock()
    tally = ScriptedTally() if priced else None
    chain = CombinationDrafter([Scripted("mtp", clock, 0.002, acceptance, samples=True)], "best" if priced else "first",
                               tally)
    chain.clock = clock
    return chain, clock, tally


def plain_rate() -> float:
    return 1.0 / (FIXED_SECONDS + SECONDS_PER_EXPERT * PER_TOKEN)


@pytest.mark.parametrize("acceptance", [0.5, 0.7])
def test_priced_by_experts_the_chooser_drafts_shorter_and_gains(acceptance):
    """Each drafted row adds experts to read: at 8 drafts a forward reads 56 experts a layer against 8 for one
    row, so a full-length draft costs more than its later tokens bring. Priced by the experts, the chooser asks for
    fewer tokens, commits more tokens per second than drafting the whole budget, and beats plain decoding."""
    full, full_clock, _ = moe_chain(acceptance, priced=False)
    priced, priced_clock, tally = moe_chain(acceptance, priced=True)
    full_run = simulate(full, full_clock, None, 600, acceptance)
    priced_run = simulate(priced, priced_clock, tally, 600, acceptance)
    assert full_run["depth"] == 8  # the whole budget every step
    assert 1 <= priced_run["choices"]["mtp"].to_dict()["mean_draft_depth"] < 4  # the depth chosen, reported
    assert priced_run["rate"] > 1.05 * full_run["rate"] and priced_run["rate"] > 1.05 * plain_rate()


def test_priced_by_experts_drafts_that_never_pay_leave_plain_decodings_speed():
    """Uniform routing and drafts a random MTP layer makes (almost never accepted): the chooser stops drafting
    and stays near plain decoding's speed (it retries now and then, as its estimates drift back to the prior)."""
    chain, clock, tally = moe_chain(0.02, priced=True)
    run = simulate(chain, clock, tally, 800, 0.02)
    assert run["choices"]["plain"].steps > 0.8 * 800
    assert run["rate"] > 0.95 * plain_rate()
    unguarded = simulate(chain, clock, tally, 100, 0.02, guard=False)  # --no-guard: every step drafts, in full
    assert unguarded["depth"] == 8 and unguarded["rate"] < 0.5 * plain_rate()


def test_a_tree_is_priced_by_its_nodes_and_drafts_only_where_that_pays():
    """A tree's every node is a verify row: on a mixture of experts 12 nodes read about 73 experts a layer where a
    3-token chain reads 29, so at the same depth and acceptance the tree promises less, here less than a plain
    step (the chooser then drafts nothing)."""
    tally = ScriptedTally()
    chooser = StepChooser(["model"], tally)
    for nodes in (0, 1, 3, 7, 11):
        tally.touched = uniform_touched(EXPERTS, PER_TOKEN, nodes + 1)
        chooser.verify.observe(nodes, FIXED_SECONDS + SECONDS_PER_EXPERT * tally.touched)
    assert chooser.promise("model", 3, 12, 0.0) < chooser.promise("model", 3, 3, 0.0)
    assert chooser.best_depth("model", 4, lambda depth: 12, lambda depth: 0.0) == 4  # its nodes cost the same
    assert chooser.promise("model", 1, 12, 0.0) < chooser.plain_promise()  # prior acceptance: the tree never pays
