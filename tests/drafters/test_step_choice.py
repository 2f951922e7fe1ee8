"""Per-step method choice on scripted drafters whose acceptance and cost are known, the estimates behind it,
and the engine: greedy output unchanged with combine="best"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import FakeClock, started
from scripted_choice import SPEC, VERIFY_SECONDS, Scripted, make_chain, simulate

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.drafters.capabilities import Batching
from specdecode.drafters.combination import LENGTHS, CombinationDrafter
from specdecode.drafters.draft_length import DraftLength
from specdecode.drafters.step_choice import PRIOR_ACCEPTANCE, MemberEstimate, StepChooser, VerifyCost
from specdecode.spec_types import DraftProposal, VerifyResult


def test_best_prefers_the_model_when_its_drafts_pay_more_than_the_lookups():
    """The case first-wins gets wrong: lookups always have a proposal but are rarely accepted."""
    first, first_clock = make_chain("first", lookup_acceptance=0.2, model_acceptance=0.9, model_cost=0.05)
    best, best_clock = make_chain("best", lookup_acceptance=0.2, model_acceptance=0.9, model_cost=0.05)
    first_run, best_run = simulate(first, first_clock, 600), simulate(best, best_clock, 600)
    assert first_run["wins"]["lookup"] == 600  # llama.cpp's rule never lets the model draft
    assert best_run["wins"]["model"] > 0.9 * 600
    assert best_run["rate"] > 1.5 * first_run["rate"]


def test_the_choice_records_what_each_member_promised_and_gave():
    """The trace the bench prints (stats' choices): every step the chooser decided is counted under its member,
    what it committed is what the steps committed, and once learnt the promise is near what the steps gave (the
    scripted clock makes that exact arithmetic, not a timing)."""
    chain, clock = make_chain("best", lookup_acceptance=0.2, model_acceptance=0.9, model_cost=0.05)
    run = simulate(chain, clock, 600)
    records = run["choices"]
    assert records["model"].steps == run["wins"]["model"]
    assert sum(r.steps for r in records.values()) == 600  # a lookup or the model proposed every step
    model = records["model"].to_dict()
    assert model["realised_tokens_per_step"] > 3  # 4-token drafts accepted 90% of the time
    promised, realised = model["promised_tokens_per_second"], model["realised_tokens_per_second"]
    assert abs(promised - realised) < 0.15 * realised


def test_each_member_keeps_its_own_draft_length():
    """One member's rejections must not shorten another's drafts. Measured before: in `auto` the draft model was
    asked for the length that suffix's rejections had cut, and drafted 1.24 tokens a step where alone it drafts
    3.3 (10 MT-bench and HumanEval prompts). Here the engine offers the most (8, twice the 4 asked for) and each
    member adapts its own length within it."""
    chain, clock = make_chain("best", lookup_acceptance=0.3, model_acceptance=0.97, model_cost=0.02)
    run = simulate(chain, clock, 400, budget=8, spec=SimpleNamespace(num_draft_tokens=4, adaptive=True, guard=True))
    assert run["lengths"]["lookup"].current <= 2 and run["lengths"]["model"].current >= 6
    model = run["choices"]["model"]
    assert model.drafted / model.steps > 5  # asked for its own length, not the lookup's


def test_a_sampling_members_cut_length_grows_back_while_it_sits_out():
    """Only a draft it makes can lengthen a member's own length, and the choice prices it at that length: a draft
    model cut to 1 token promised no more than suffix's 1-token proposals and stayed cut while they ran (#62). While
    it sits out, its length grows back to the initial one (not beyond: that is earned by accepted drafts); a
    lookup, judged on the proposal it makes, keeps its own."""
    length = DraftLength(4, adaptive=True)
    for _ in range(5):
        length.update(4, 0)
    assert length.current == 1
    for _ in range(10):
        length.regain()
    assert length.current == 4
    chain, clock = make_chain("best", lookup_acceptance=0.5, model_acceptance=0.8, model_cost=0.02)
    seq = SimpleNamespace(drafter_state={}, choices={}, tokens=[0] * 10, generated=0,
                          spec=SimpleNamespace(num_draft_tokens=4, adaptive=True, guard=True))
    chain.start(seq, None)
    lengths = seq.drafter_state[LENGTHS]
    lengths["model"].current = lengths["lookup"].current = 1
    seq.drafter_state["combination"] = (0.0, 0.0, 2, 2, None)  # a step the lookup drafted, 2 deep
    chain.commit(seq, VerifyResult([], [1], "lookup"), None)
    assert lengths["model"].current == 2 and lengths["lookup"].current == 1


def test_best_keeps_the_free_lookups_when_they_are_accepted():
    best, clock = make_chain("best", lookup_acceptance=0.9, model_acceptance=0.9, model_cost=0.2)
    run = simulate(best, clock, 600)
    assert run["wins"]["lookup"] > 0.9 * 600
    model = best.members[1]
    assert model.asked < 0.1 * 600  # the costly member is not asked when it would not be used


def test_best_is_never_far_below_the_better_single_member():
    for lookup_acceptance, model_acceptance, model_cost in [(0.2, 0.9, 0.05), (0.9, 0.6, 0.2), (0.5, 0.7, 0.1)]:
        rates = []
        for combine in ("best", "first"):
            chain, clock = make_chain(combine, lookup_acceptance, model_acceptance, model_cost)
            rates.append(simulate(chain, clock, 800)["rate"])
        alone = []
        for member in ("lookup", "model"):
            clock = FakeClock()
            acceptance, cost = (lookup_acceptance, 0.001) if member == "lookup" else (model_acceptance, model_cost)
            single = CombinationDrafter([Scripted(member, clock, cost, acceptance, samples=member == "model")], "best")
            single.clock = clock
            alone.append(simulate(single, clock, 800)["rate"])
        assert rates[0] >= 0.93 * max(alone), (lookup_acceptance, model_acceptance, rates, alone)


def test_no_drafts_when_no_member_promises_more_than_a_plain_step():
    """A costly member that is rarely accepted: the chooser leaves most steps plain (retrying it now and then,
    as its estimates drift back to the prior) and stays near plain decoding's one token per forward."""
    clock = FakeClock()
    chain = CombinationDrafter([Scripted("model", clock, 0.5, 0.05, samples=True)], "best")
    chain.clock = clock
    run = simulate(chain, clock, 800)
    assert run["wins"]["plain"] > 0.8 * 800 and "chooser_plain" in run["withheld"]
    assert run["rate"] > 0.85 / VERIFY_SECONDS


def test_a_sampling_member_once_asked_is_used_even_if_a_lookup_looks_better_after():
    """Losslessness: whether a sampled draft is used must not depend on what was sampled."""
    chain, _clock = make_chain("best", lookup_acceptance=0.5, model_acceptance=0.99, model_cost=0.01)
    seq = SimpleNamespace(drafter_state={}, choices={}, tokens=[0] * 10, sampling=SimpleNamespace(max_tokens=64),
                          generated=0, spec=SPEC)
    chain.start(seq, None)
    for _ in range(50):
        before = chain.members[1].asked
        proposal = chain.propose(seq, 4)
        if chain.members[1].asked > before:
            assert proposal.source == "model"
        chain.commit(seq, VerifyResult([], [1], proposal.source), None)


class Batched(Scripted, Batching):
    """A Scripted member whose forwards batch: one propose_many for all its requests, at the cost of one; it
    has nothing to propose for the requests in `empty_for` (by object)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []  # requests per propose_many call
        self.empty_for: list = []

    def propose_many(self, seqs, budgets):
        self.batches.append(len(seqs))
        self.clock.now += self.seconds_per_token * max(budgets)
        return [DraftProposal.empty(self.name) if any(seq is e for e in self.empty_for)
                else DraftProposal.chain([1] * budget, source=self.name) for seq, budget in zip(seqs, budgets)]


def test_in_a_batch_the_requests_choosing_one_model_member_draft_together():
    """Each request ranks the members as alone; those whose choice is one sampling member are asked in one
    propose_many, and one it leaves without a proposal goes on to its next choice."""
    clock = FakeClock()
    first = Batched("first", clock, 0.01, 0.9, samples=True)
    second = Batched("second", clock, 0.02, 0.6, samples=True)
    chain = CombinationDrafter([first, second], "best")
    chain.clock = clock
    seqs = [SimpleNamespace(drafter_state={}, choices={}, tokens=[0] * 10, sampling=SimpleNamespace(max_tokens=64),
                            generated=0, spec=SPEC) for _ in range(4)]
    for seq in seqs:
        chain.start(seq, None)
    first.empty_for = [seqs[2]]
    for _ in range(3):  # what each member is worth, learnt one request at a time
        for seq in seqs[:2]:
            proposal = chain.propose(seq, 4)
            clock.now += VERIFY_SECONDS
            chain.commit(seq, VerifyResult([1] * 3, [1] * 4, proposal.source), None)
    first.batches.clear()
    proposals = chain.propose_many(seqs, [4, 4, 4, 0])
    assert first.batches == [3], "the three requests asked for tokens draft in one call"
    assert second.batches[-1] == 1, "the request the first choice left empty was asked next, alone"
    assert [p.source for p in proposals[:3]] == ["first", "first", "second"]
    assert proposals[3].size == 0 and "combination" not in seqs[3].drafter_state


def test_estimates():
    estimate = MemberEstimate()
    assert estimate.acceptance(0) == PRIOR_ACCEPTANCE
    assert estimate.expected_accepted(2) == pytest.approx(0.5 + 0.25)
    estimate.accepted, estimate.examined = [98.0], [98.0]
    assert estimate.acceptance(0) == pytest.approx(0.99) and estimate.acceptance(1) == PRIOR_ACCEPTANCE
    cost = VerifyCost()
    assert cost.predict(3) == 0.0
    for nodes in [0, 2, 4, 8] * 10:
        cost.observe(nodes, 0.02 + 0.005 * nodes)
    assert cost.predict(6) == pytest.approx(0.05) and cost.predict(0) == pytest.approx(0.02)
    flat = VerifyCost()
    for _ in range(5):
        flat.observe(3, 0.04)
    assert flat.predict(8) == pytest.approx(0.04)


def test_a_lookup_without_evidence_is_tried_only_where_its_proposal_could_win():
    """A try teaches what a lookup is worth, but one that could not beat the best candidate even with every token
    accepted costs the step and shows nothing (#62: a fresh process's first request tried suffix's 1-token
    proposals in place of the draft model's 3-4 tokens)."""
    def run_with(lookup_tokens: int) -> dict:
        clock = FakeClock()

        class Short(Scripted):
            def propose(self, seq, budget: int) -> DraftProposal:
                return super().propose(seq, min(budget, lookup_tokens))

        model = Scripted("model", clock, 0.02, 0.8, samples=True)
        chain = CombinationDrafter([model, Short("lookup", clock, 0.001, 0.95, samples=False)], "best")
        chain.clock = clock
        learnt = chain.chooser.members["model"]  # as after earlier requests: 3.36 tokens in 1.08 s a step
        learnt.accepted, learnt.examined = [80.0, 64.0, 51.0, 41.0], [100.0, 80.0, 64.0, 51.0]
        learnt.seconds_per_token = 0.02
        for nodes in range(5):
            chain.chooser.verify.observe(nodes, VERIFY_SECONDS)
        return simulate(chain, clock, 30)

    assert run_with(1)["wins"]["lookup"] == 0, "2 tokens at best in a step: never above the model's 3.1 a second"
    assert run_with(4)["wins"]["lookup"] > 0, "5 tokens at best: tried"


def test_a_lookups_proposal_is_judged_by_its_proposals_of_the_same_depth():
    """A lookup proposes as deep as its match reaches, so depth tells how well a proposal is backed (suffix on
    plain answers: 25% of 1-token proposals accepted, the first token of 93% of 8-token ones). Pooled over depths,
    its long matches' record priced a 1-token match as one of them."""
    chooser = StepChooser(["lookup", "model"])
    for _ in range(10):
        chooser.record_verdict("lookup", 1, 0, 1, 0.1)  # shallow matches: rejected
        chooser.record_verdict("lookup", 6, 6, 6, 0.1)  # long matches: all accepted
    shallow, _ = chooser.expected_lookup("lookup", 1, 1)
    deep, _ = chooser.expected_lookup("lookup", 6, 6)
    pooled = chooser.members["lookup"].expected_accepted(1) + 1
    assert shallow < 1.2 < pooled, "a 1-deep proposal is priced by the 1-deep record, not the pooled one"
    assert deep > chooser.members["lookup"].expected_accepted(6) + 1 + 1.5, "and a 6-deep one by the 6-deep record"
    unseen, _ = chooser.expected_lookup("lookup", 3, 3)
    assert unseen == pytest.approx(chooser.members["lookup"].expected_accepted(3) + 1), \
        "a depth without verdicts of its own is priced by the member's record over all depths"


def test_a_bad_rule_is_one_clear_error():
    with pytest.raises(SpecDecodeError, match="combine must be one of first, best"):
        SpecConfig("ngram,draft", combine="fastest")


@pytest.fixture(scope="module")
def engine(noisy_pair):
    return Engine(*noisy_pair)


@pytest.mark.parametrize("method", ["ngram,draft", "draft,ngram", "suffix,draft", "ngram,suffix"])
def test_greedy_output_is_plain_decoding_with_combine_best(engine, method):
    sampling = SamplingParams(max_tokens=48, ignore_eos=True)
    spec = SpecConfig(method, combine="best", guard=False)
    sources = set()
    for prompt in ["1 2 3 1 2 3 1 2", "hello hello hello", "The quick brown fox"]:
        plain = engine.complete(prompt, sampling, SpecConfig("none"))
        result = engine.complete(prompt, sampling, spec)
        assert result.token_ids == plain.token_ids, (method, prompt)
        sources |= set(result.stats.drafted_by)
    assert sources  # drafts were verified
    assert engine.drafter(spec) is not engine.drafter(SpecConfig(method))  # each rule keeps its own estimates


def test_a_draft_model_reads_the_prompt_at_start_only_where_every_step_may_use_it(engine):
    """With per-step choice the draft model's prompt forward waits until it is first chosen; a first-wins
    chain reads the prompt in the prefill phase, as before."""
    prompt = engine.encode("hello hello hello")
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    deferred = started(engine, prompt, sampling, SpecConfig("ngram,draft", combine="best", guard=False))
    eager = started(engine, prompt, sampling, SpecConfig("ngram,draft", guard=False))
    assert deferred.drafter_state["draft"].lengths[0] == 0
    assert eager.drafter_state["draft"].lengths[0] == len(prompt)
    for seq in (deferred, eager):
        engine.finish(seq)


def test_a_lookup_the_prior_undersells_is_tried_and_then_preferred():
    """A model member learns its worth where a lookup, judged on the prior alone, would never be chosen: the
    lookup is tried while it has no evidence, and wins once its estimates show it is accepted more."""
    clock = FakeClock()
    lookup = Scripted("lookup", clock, 0.001, 0.95, samples=False)
    model = Scripted("model", clock, 0.02, 0.8, samples=True)
    chain = CombinationDrafter([model, lookup], "best")
    chain.clock = clock
    learnt = chain.chooser.members["model"]  # as after requests the lookup had nothing for
    learnt.accepted, learnt.examined = [80.0, 64.0, 51.0, 41.0], [100.0, 80.0, 64.0, 51.0]
    learnt.seconds_per_token = 0.02
    run = simulate(chain, clock, 600)
    single = CombinationDrafter([Scripted("lookup", clock, 0.001, 0.95, samples=False)], "best")
    single.clock = clock
    assert run["wins"]["lookup"] > 0.8 * 600
    assert run["rate"] >= 0.93 * simulate(single, clock, 600)["rate"]
