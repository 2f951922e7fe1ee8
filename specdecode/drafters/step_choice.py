"""Per-step method choice for combinations ('ngram,draft' with combine="best"): each step, the member whose
proposal promises the most committed tokens per second of what is still to spend.

llama.cpp's rule (combine="first") lets the first member with a proposal win, so an n-gram match beats the
draft model even where the draft model would have been accepted more often. Here each member's promise is
(expected accepted tokens + 1) / (its drafting time still to spend + the verify forward's time), from online
estimates kept for the Engine's life: acceptance by draft position per member, drafting seconds per drafted
token per member, and verify seconds as a line in the number of drafted nodes, or on a mixture of experts in the
distinct experts those rows touch (verify_cost.py). There a sampling member is also asked for the depth that
promises the most (best_depth): each drafted row can add experts for the verify forward to read.

Doing nothing is a candidate too: when no member promises more than a step without drafts (1 token over the
verify line's cost at 0 nodes), the step drafts nothing, and counts as "chooser_plain" in the stats.

A member that can begin a request without the prefill (a draft model, capabilities.DeferredStart) starts only when
first chosen, so a request the lookups serve alone never pays its prompt forward. That catch-up on the whole
context is an investment in the rest of the request: a step is charged its share, (depth + 1) / tokens left,
of the estimated catch-up (seconds per context token, measured the first times it happens). Until one has been
measured, in a request or by the warm-up (below), it is priced at the target's own prefill rate
(Sequence.target_prefill_seconds_per_token), as the batched load budget prices it: a bound, where pricing it at
nothing let a fresh process's first request start the draft model on a long prompt for a few steps of a short
answer (#62: a fresh process per answer, extraction). The step that catches up is flagged (DraftProposal.caught_up)
so that the speed guard, which judges windows of steps, does not take that one-off for drafting that loses. A
started member that fell behind (more than combination.LAGGING_TOKENS committed while other members or plain steps
ran) catches up the same way, priced and timed as a start: timed as drafting, one such read of 232 tokens took
327 ms for one drafted token and priced the draft model out of the rest of its request (#62: a fresh process per
answer, coding).

Until a member's costs are timed in a request, they are what this process's warm-up measured of it drafting alone
(WarmMeasure, engine/warm_up.py): a warm draft model's seconds per drafted token and per prompt token of its start.
Before, an untimed member drafted for free ("try it once"), so a process's first request chose the draft model on
promises it could not keep (#62: a fresh process per answer, 5 draft-model steps promised 70.7 tokens/s and gave
25.1). Requests' timings then move the estimate away from the warm-up's a step at a time (COST_SMOOTHING), for the
Engine's life, so that one slow timing cannot price a member out. The acceptance the warm-up measured is that
member's prior in place of PRIOR_ACCEPTANCE: at 0.5 a draft model that is accepted 70-80% of the time on its
target promised less than a plain step at its real cost, so a process's first request hardly tried it (#62: a
fresh process per answer, coding: 3 draft-model steps in 242, where `draft` alone ran 1.44x).

A lookup with almost no evidence behind its estimates (MIN_EVIDENCE) is tried when it proposes, since the
prior alone can hide a good one behind a member that has learnt its worth; but only a proposal that, every token
accepted, would beat the best candidate (combination.py): one that could not win cannot show the lookup worth
choosing, and in a fresh process's first request such tries of suffix's 1-token proposals took steps from the
draft model.

A lookup's proposal is judged by what its proposals of the same depth were worth (`by_depth`), leaning on its
estimate over all depths until those have evidence of their own. A lookup proposes as deep as its match reaches
(suffix: a draft token per matched token), so its depth says how well the proposal is backed: on the plain answers
of 36 MT-bench and HumanEval prompts (the seventh session's 6c09399 run) suffix's 1-token proposals had their first
token accepted 25% of the time, its 4-token ones 68%, its 8-token ones 93%. Pooled over depths, the estimate
priced a 1-token proposal as if it were a long match's, and a process's first request chose suffix's shallow
proposals over the draft model's (#62: a fresh process per answer, reasoning: two 0-accepted suffix steps).

Losslessness needs the choice to be made before a random draft is drawn: a member that samples its drafts
(caps.emits_probs) is judged on its estimates alone and, once asked, its proposal is used (a choice that looked
at sampled tokens would skew the law they were drawn from under rejection sampling; under the coupled rule no
choice can change the output). Deterministic members (lookups) cost little, are
asked every step, and are judged on the proposal they made.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdecode.drafters.verify_cost import VerifyCost

if TYPE_CHECKING:
    from specdecode.models.decoder.moe import ExpertTally

PRIOR_ACCEPTANCE = 0.5  # before any evidence, each draft position is accepted half the time (or: WarmMeasure's)
PRIOR_WEIGHT = 2.0  # pseudo-observations behind that prior
FORGET = 0.99  # each step every count decays: a member not chosen for long drifts back to the prior and is retried
# A lookup whose first position has less evidence than this is tried when it proposes what could win (above):
# its proposals cost nothing, and the prior alone can keep a good one from ever being chosen (measured: a bf16
# target where the draft model's learnt estimate always beat suffix's prior). Evidence decays, so an unchosen
# lookup is retried about every 70 steps (ln 2 / (1 - FORGET)).
MIN_EVIDENCE = 1.0
COST_SMOOTHING = 0.2  # weight of the newest timing in the running cost estimates


@dataclass(frozen=True)
class WarmMeasure:
    """What the warm-up measured of a member drafting alone, outside any request (engine/warm_up.py): per-step
    choice's costs until a request times them, and its prior acceptance."""

    seconds_per_token: float  # drafting time per drafted token
    seconds_per_start_token: float | None  # a start's time per prompt token (None: not measured)
    acceptance: float | None = None  # P(an examined draft token accepted) (None: too few verdicts to say)
    verify_seconds: float | None = None  # the target's mean verify step behind its drafts (None: not measured)


@dataclass
class MemberEstimate:
    accepted: list[float] = field(default_factory=list)  # per position: decayed count of acceptances
    examined: list[float] = field(default_factory=list)  # per position: decayed count of verdicts
    seconds_per_token: float = 0.0  # drafting time per drafted token (0 until timed in a request)
    seconds_per_start_token: float = 0.0  # a catch-up's time per context token read (0 until timed)

    def evidence(self) -> float:
        """Decayed count of verdicts on the first draft position."""
        return self.examined[0] if self.examined else 0.0

    def acceptance(self, position: int, prior: float = PRIOR_ACCEPTANCE) -> float:
        """P(draft at `position` accepted | every earlier one was), its verdicts weighed with `prior`."""
        hits = self.accepted[position] if position < len(self.accepted) else 0.0
        seen = self.examined[position] if position < len(self.examined) else 0.0
        return (hits + prior * PRIOR_WEIGHT) / (seen + PRIOR_WEIGHT)

    def expected_accepted(self, depth: int, prior: float | list[float] = PRIOR_ACCEPTANCE) -> float:
        """Expected accepted tokens of a `depth`-deep draft: sum over positions of P(all up to it accepted).
        prior: one for every position, or each position's own."""
        total, survive = 0.0, 1.0
        for position in range(depth):
            survive *= self.acceptance(position, prior[position] if isinstance(prior, list) else prior)
            total += survive
        return total

    def without(self, part: MemberEstimate) -> MemberEstimate:
        """The counts left after taking away `part`'s (a subset of these verdicts, decayed alike)."""
        def left(total: list[float], taken: list[float]) -> list[float]:
            return [max(0.0, x - (taken[i] if i < len(taken) else 0.0)) for i, x in enumerate(total)]
        return MemberEstimate(left(self.accepted, part.accepted), left(self.examined, part.examined))

    def forget(self) -> None:
        """One step older: every count decays (FORGET)."""
        self.accepted = [FORGET * x for x in self.accepted]
        self.examined = [FORGET * x for x in self.examined]

    def add(self, examined: int, accepted: int) -> None:
        """A verdict: the first `examined` positions judged, the first `accepted` of them kept."""
        missing = examined - len(self.examined)
        if missing > 0:
            self.accepted += [0.0] * missing
            self.examined += [0.0] * missing
        for position in range(examined):
            self.examined[position] += 1
            self.accepted[position] += position < accepted


def smoothed(estimate: float, newest: float) -> float:
    """A running estimate after its newest value (0 = none yet: the newest is taken as is)."""
    return newest if estimate == 0.0 else estimate + COST_SMOOTHING * (newest - estimate)


def rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("inf")


class StepChooser:
    """The estimates behind the choice, for one combination of one Engine (shared by its requests)."""

    def __init__(self, members: list[str], tally: ExpertTally | None = None,
                 warm_measures: Mapping[str, WarmMeasure] | None = None) -> None:
        """warm_measures: member name -> what the warm-up measured of it alone (read when needed, so a chooser
        built before the warm-up uses them too); a member with none drafts for free until timed, from the prior."""
        self.members = {name: MemberEstimate() for name in members}
        # (member, proposal depth) -> the verdicts on that member's proposals of that depth (read for lookups)
        self.by_depth: dict[tuple[str, int], MemberEstimate] = {}
        self.verify = VerifyCost(tally)
        self.warm_measures = {} if warm_measures is None else warm_measures
        self.answer_tokens = 0.0  # running mean of the lengths of the answers that ended (0: none yet)

    def expected(self, member: str, depth: int, nodes: int, draft_seconds_left: float) -> tuple[float, float]:
        """(committed tokens, seconds) a proposal `depth` deep with `nodes` nodes is expected to give and cost."""
        return (self.members[member].expected_accepted(depth, self.prior(member)) + 1,
                draft_seconds_left + self.verify_seconds(nodes))

    def expected_lookup(self, member: str, depth: int, nodes: int) -> tuple[float, float]:
        """(committed tokens, seconds) a lookup's proposal `depth` deep with `nodes` nodes is expected to give and
        cost: by the verdicts on its proposals of that depth, each position's prior (weighed as PRIOR_WEIGHT
        verdicts) what its proposals of other depths were worth, since its depth tells how long its match was
        (module docstring)."""
        own = self.by_depth.get((member, depth), MemberEstimate())
        others = self.members[member].without(own)  # counted once: a lookup of one depth prices as before
        priors = [others.acceptance(position, self.prior(member)) for position in range(depth)]
        return own.expected_accepted(depth, priors) + 1, self.verify_seconds(nodes)

    def verify_seconds(self, nodes: int) -> float:
        """A verify step's estimated seconds with `nodes` drafted nodes: the line requests timed, or before any
        verify step was timed, the warm-up's mean step (0 with neither: a first step then promised infinitely
        much, so a fresh process's first request started the draft model at its first step, whatever its prompt)."""
        timed = self.verify.predict(nodes)
        if timed:
            return timed
        return next((m.verify_seconds for m in self.warm_measures.values() if m.verify_seconds is not None), 0.0)

    def prior(self, member: str) -> float:
        """The acceptance `member`'s estimates start from: what the warm-up measured of it, else PRIOR_ACCEPTANCE."""
        warm = self.warm_measures.get(member)
        return warm.acceptance if warm is not None and warm.acceptance is not None else PRIOR_ACCEPTANCE

    def promise(self, member: str, depth: int, nodes: int, draft_seconds_left: float) -> float:
        """Committed tokens per second a proposal `depth` deep with `nodes` nodes is expected to give."""
        return rate(*self.expected(member, depth, nodes, draft_seconds_left))

    def best_depth(self, member: str, budget: int, nodes: Callable[[int], int],
                   drafting_seconds: Callable[[int], float]) -> int:
        """How deep to ask a sampling member to draft (at most `budget`): the depth whose expected committed tokens
        per second are highest, a draft `depth` deep holding nodes(depth) nodes and costing drafting_seconds(depth).
        Only where verification is priced by the experts it touches (verify_cost.py): there each drafted row may
        add experts to read, so a deeper draft, or a tree, can cost more than it brings. A dense target's verify
        line is nearly flat in its rows, and its draft length stays the engine's (draft_length.py, the guard)."""
        if budget <= 1 or not self.verify.priced_by_experts:
            return budget

        def promise(depth: int) -> float:
            return self.promise(member, depth, nodes(depth), drafting_seconds(depth))

        best = max(range(1, budget + 1), key=lambda depth: (promise(depth), depth))
        # A position never drafted keeps the prior acceptance, which can hide a depth that pays: one position
        # deeper is tried, where it still beats a plain step, while the next position has too little evidence
        # (evidence decays, so now and then again).
        examined = self.members[member].examined
        unexplored = best < budget and (best >= len(examined) or examined[best] < MIN_EVIDENCE)
        return best + 1 if unexplored and promise(best + 1) >= self.plain_promise() else best

    def plain_promise(self) -> float:
        """Committed tokens per second of a step without drafts (0 until a verify step was timed or warm-measured)."""
        seconds = self.verify_seconds(0)
        return 1.0 / seconds if seconds > 0 else 0.0

    def drafting_seconds(self, member: str, tokens: int) -> float:
        """Estimated seconds to draft `tokens` tokens: at the rate requests timed, else the warm-up's, else free."""
        warm = self.warm_measures.get(member)
        return (self.members[member].seconds_per_token or (warm.seconds_per_token if warm else 0.0)) * tokens

    def start_seconds(self, member: str, context_tokens: int, unmeasured_per_token: float | None) -> float:
        """Estimated seconds for a member to catch up on `context_tokens` before its next proposal: at the rate
        requests timed, else the warm-up's, else at `unmeasured_per_token` (the target's prefill rate, a bound),
        else free."""
        warm = self.warm_measures.get(member)
        per_token = (self.members[member].seconds_per_start_token or (warm and warm.seconds_per_start_token)
                     or unmeasured_per_token or 0.0)
        return per_token * context_tokens

    def record_start(self, member: str, seconds: float, context_tokens: int, tokens: int) -> None:
        """A member's proposal that first caught up (its deferred start, or a context it fell behind on): `seconds`
        for reading `context_tokens` and drafting `tokens`; the reading is what is left after the usual drafting
        time."""
        per_token = max(0.0, seconds - self.drafting_seconds(member, tokens)) / max(1, context_tokens)
        self.members[member].seconds_per_start_token = smoothed(self.start_seconds(member, 1, None), per_token)

    def record_drafting(self, member: str, seconds: float, tokens: int) -> None:
        """`tokens` drafted in `seconds`. The running estimate starts from the warm-up's measure where there is one:
        taken as is, one slow first timing (90 ms for 4 tokens, about twice the usual) priced the draft model below a
        plain step for the rest of a long-lived process, since a member not chosen is never timed again (#62)."""
        if tokens:
            self.members[member].seconds_per_token = smoothed(self.drafting_seconds(member, 1), seconds / tokens)

    def record_answer(self, tokens: int) -> None:
        """A request ended after generating `tokens`: how long answers run here prices later catch-ups."""
        self.answer_tokens = smoothed(self.answer_tokens, tokens)

    def needs_evidence(self, member: str) -> bool:
        """Whether a lookup's estimates rest on too few verdicts to judge its proposal by (MIN_EVIDENCE)."""
        return self.members[member].evidence() < MIN_EVIDENCE

    def record_verdict(self, member: str, depth: int, accepted: int, nodes: int, verify_seconds: float) -> None:
        """After the target judged `member`'s proposal: `accepted` of its `depth` positions kept."""
        for estimate in [*self.members.values(), *self.by_depth.values()]:
            estimate.forget()
        self.verify.observe(nodes, verify_seconds)
        if member not in self.members or depth == 0:
            return
        examined = min(depth, accepted + 1)  # positions after the first rejection were never judged
        self.members[member].add(examined, accepted)
        self.by_depth.setdefault((member, depth), MemberEstimate()).add(examined, accepted)
