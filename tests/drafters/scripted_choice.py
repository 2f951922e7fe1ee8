"""Scripted drafters whose acceptance and cost are known, and a scripted request through a combination under
per-step choice: what tests of the choice (test_step_choice.py, test_choice_catch_up.py, test_verify_cost.py)
run their members on."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import ClassVar

from conftest import FakeClock

from specdecode.drafters.base import Drafter, DrafterCaps
from specdecode.drafters.capabilities import DeferredStart
from specdecode.drafters.combination import LENGTHS, CombinationDrafter
from specdecode.drafters.step_choice import WarmMeasure
from specdecode.spec_types import DraftProposal, VerifyResult

VERIFY_SECONDS = 1.0  # a scripted target forward, whatever the number of drafted nodes
SPEC = SimpleNamespace(num_draft_tokens=4, adaptive=False, guard=True)  # what a scripted request asks for


class Scripted(Drafter):
    """Proposes `budget` tokens at `seconds_per_token` each; each is accepted with probability `acceptance`."""

    caps: ClassVar[DrafterCaps] = DrafterCaps()

    def __init__(self, name: str, clock: FakeClock, seconds_per_token: float, acceptance: float, samples: bool):
        self.name, self.clock, self.seconds_per_token, self.acceptance = name, clock, seconds_per_token, acceptance
        self.caps = DrafterCaps(emits_probs=samples)
        self.asked = 0

    @classmethod
    def create(cls, resources, options):
        raise TypeError("built by hand in these tests")

    def propose(self, seq, budget: int) -> DraftProposal:
        self.asked += 1
        self.clock.now += self.seconds_per_token * budget
        return DraftProposal.chain([1] * budget, source=self.name)


class Deferred(Scripted, DeferredStart):
    """A Scripted member that can start late: its first proposal of a request first reads the whole context at
    `start_seconds_per_token` per token (a draft model's prompt forward)."""

    def __init__(self, *args, start_seconds_per_token: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.start_seconds_per_token = start_seconds_per_token
        self.started = 0

    def defer_start(self, seq) -> None:
        seq.drafter_state[self.name] = 0  # context tokens read so far

    def pending_tokens(self, seq) -> int:
        return len(seq.tokens) - seq.drafter_state[self.name]

    def propose(self, seq, budget: int) -> DraftProposal:
        if seq.drafter_state[self.name] == 0:
            self.started += 1
            self.clock.now += self.start_seconds_per_token * len(seq.tokens)
        seq.drafter_state[self.name] = len(seq.tokens)
        return super().propose(seq, budget)


def simulate(chain: CombinationDrafter, clock: FakeClock, steps: int, budget: int = 4, seed: int = 0,
             prompt_len: int = 100, spec: SimpleNamespace | None = None, prefill_per_token: float | None = None,
             max_tokens: int | None = None) -> dict:
    """Script a request of `steps` steps through the chain (the target read its prompt at `prefill_per_token`
    seconds a token, None: unknown; max_tokens 4 a step unless given); -> tokens per second, how often each member
    won (and "plain", steps the chooser left without drafts), the empty proposals' reasons and how many proposals
    caught up."""
    rng = random.Random(seed)
    members = {m.name: m for m in chain.members}
    seq = SimpleNamespace(drafter_state={}, choices={}, tokens=[0] * prompt_len,
                          sampling=SimpleNamespace(max_tokens=max_tokens or 4 * steps), generated=0,
                          spec=spec or SimpleNamespace(num_draft_tokens=budget, adaptive=False, guard=True),
                          target_prefill_seconds_per_token=prefill_per_token)
    chain.start(seq, None)
    began, committed, wins, withheld, caught_up = clock.now, 0, dict.fromkeys([*members, "plain"], 0), set(), 0
    for _ in range(steps):
        proposal = chain.propose(seq, budget)
        clock.now += VERIFY_SECONDS
        accepted = 0
        while accepted < proposal.size and rng.random() < members[proposal.source].acceptance:
            accepted += 1
        chain.commit(seq, VerifyResult(list(range(accepted)), [1] * (accepted + 1), proposal.source), None)
        committed += accepted + 1
        seq.tokens += [1] * (accepted + 1)
        seq.generated += accepted + 1
        wins[proposal.source if proposal.size else "plain"] += 1
        withheld.add(proposal.withheld)
        caught_up += proposal.caught_up
    lengths = seq.drafter_state.get(LENGTHS)  # None under first-wins
    chain.finish(seq)  # the request ends: its length counts towards the next one's (StepChooser.answer_tokens)
    return {"rate": committed / (clock.now - began), "wins": wins, "withheld": withheld, "choices": seq.choices,
            "lengths": lengths,
            "caught_up": caught_up}  # proposals flagged as a deferred member's catch-up (for the speed guard)


def make_chain(combine: str, lookup_acceptance: float, model_acceptance: float, model_cost: float,
               warm_measures: dict[str, WarmMeasure] | None = None):
    clock = FakeClock()
    lookup = Scripted("lookup", clock, 0.001, lookup_acceptance, samples=False)
    model = Scripted("model", clock, model_cost, model_acceptance, samples=True)
    chain = CombinationDrafter([lookup, model], combine, warm_measures=warm_measures)
    chain.clock = clock
    return chain, clock


def deferred_chain(start_seconds_per_token: float, lookup_acceptance: float = 0.5):
    clock = FakeClock()
    lookup = Scripted("lookup", clock, 0.001, lookup_acceptance, samples=False)
    model = Deferred("model", clock, 0.05, 0.9, samples=True, start_seconds_per_token=start_seconds_per_token)
    chain = CombinationDrafter([lookup, model], "best")
    chain.clock = clock
    return chain, clock, model


class Lagging(Deferred):
    """A Deferred member that, as a draft model does, first reads every token committed since it last proposed."""

    def propose(self, seq, budget: int) -> DraftProposal:
        if seq.drafter_state[self.name]:
            self.clock.now += self.start_seconds_per_token * self.pending_tokens(seq)
        return super().propose(seq, budget)


class Phased(Scripted):
    """A lookup that finds matches in runs of `run` steps, then none for as many (code, then prose)."""

    run = 50

    def propose(self, seq, budget: int) -> DraftProposal:
        proposal = super().propose(seq, budget)
        return proposal if (self.asked - 1) // self.run % 2 == 0 else DraftProposal.empty(self.name)

