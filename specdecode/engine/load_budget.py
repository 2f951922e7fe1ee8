"""Speculation that knows the load: in a batched step, how many tokens each sequence may draft.

A batch of n sequences each drafting k tokens runs n(k+1) rows through the target (shorter proposals are
padded to the longest). On a CPU a forward's time grows with its rows, slowly while the weights' stream
dominates and steeply once the batch alone keeps the cores busy; from there drafts cost more than they return.
Each batched step picks the one draft length k (0 = plain batching) that maximises the expected committed
tokens per second,

    rate(k) = sum_i (1 + a_i + a_i^2 + ... + a_i^min(k, w_i)) / (forward(rows(k)) + sum_i min(k, w_i) d_i),

from online estimates: a forward's seconds by its rows (every step measures one), each sequence's acceptance a_i
per drafted position (accepted positions over tried ones: a geometric model) and its drafting seconds per drafted
token d_i; w_i is what the sequence's own draft length asks. A row count never measured is interpolated between
measured ones; below the smallest it is taken to scale down in proportion, and above the largest to grow on the
slope of the last two (to stay flat while only one is known), so that an unmeasured choice gets tried and
measured rather than assumed away, yet a count that proposals never fill (a batch's longest n-gram match is
often shorter than the cap) is not taken for free. This is
vLLM's `disable_by_batch_size` measured on this machine instead of set by hand, and it never falls below plain
batching for long: plain batching is one of the choices, scored on the same clock.

Acceptance is learnt from every step that drafted, alone or batched. A new request starts from what its method has
shown on earlier requests (worth a few positions), not from nothing, and so does its drafting cost (taken as free,
it would let a batch of new requests draft 4 tokens each where that does not pay: a forward of 20 rows costs 4.5x
one of 4 on AVX2); and while plain batching wins by a small margin, one step in PROBE_EVERY drafts at the best
positive length anyway, so that estimates made under other conditions (an early guess, another prompt) get the
chance to change the verdict; but no probe catches up.

A draft model that has not drafted for a while (a request that started under load, or `auto` deferring it until
first chosen) must first read every token it missed: a catch-up that cost a batch of 4 requests 5 s in one step
(docs/benchmarks, 2026-12-03 AVX2). A step in which some requests caught up is learnt apart, per method, as
seconds per token caught up (its whole drafting time over the tokens read: a drafter's time is shared among the
requests it drafted for, so no one request's share would tell), and a step that would catch up is charged its
share of that, (k + 1) / tokens left of the request (the catch-up serves the request's later steps too; per-step
choice charges a deferred start the same way). A drafter that reads the prompt when its request starts (a draft
model under `draft`) shows there what a token read costs, before any catch-up; one that defers it (`auto`) has
its catch-ups priced at what the target's own prefill costs a token until one has been measured: a bound from
above, since a drafter that reads tokens runs a model smaller than the target (taken as free, `auto`'s first
catch-up at 4 slots costs one step 1.7-2.5 s, all four prompts at once: docs/benchmarks, 2026-12-04).
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass, field

from specdecode.drafters import capabilities
from specdecode.spec_types import Sequence

SMOOTHING = 0.2  # weight of the newest measurement in each running estimate
PRIOR_TRIED = 4.0  # a new request's acceptance starts at its method's so far, worth this many tried positions
FIRST_ACCEPTANCE = 0.5  # a method's acceptance before any request of it drafted
PROBE_EVERY = 16  # plain batched steps between two that draft anyway
PROBE_MARGIN = 0.8  # ... when drafting's expected rate is at least this share of plain batching's
# A drafter with more committed tokens than this to read first is catching up. Above PROBE_EVERY plus a draft: a
# probe after a run of plain steps reads what they committed, and that is part of what a probe costs.
CATCH_UP_TOKENS = 32


@dataclass
class _Estimate:
    accepted: float  # drafted positions the target accepted
    tried: float  # drafted positions verified, up to and including the first rejection
    draft_seconds_per_token: float | None = None  # None: neither it nor its method drafted yet
    pending: int = 0  # tokens its drafter had to read first, as of the batched step being decided (0 after it)
    catch_up_seconds_per_token: float | None = None  # per method only: None until a catch-up was timed

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried


@dataclass
class _StepDrafting:
    """One step's drafting by the requests of one method, sorted out when the step ends (`end_step`)."""

    seconds: float = 0.0  # every drafting request's share of its drafter's time
    usual: float = 0.0  # what their drafting costs when no one catches up
    caught_up: int = 0  # tokens read by the requests that caught up
    per_token: list[tuple[_Estimate, float]] = field(default_factory=list)  # (request, its seconds per drafted token)


class BatchDraftBudget:
    """One Engine's estimates; `draft_cap` before a batched step, `observe_*` and `end_step` after it."""

    def __init__(self) -> None:
        self.forward_seconds: dict[int, float] = {}  # rows -> running mean of a forward's seconds
        self._sequences: weakref.WeakKeyDictionary[Sequence, _Estimate] = weakref.WeakKeyDictionary()
        self._methods: dict[str, _Estimate] = {}  # every request of a method together
        self.plain_steps = 0  # batched steps in a row that drafted nothing
        self.prefill_seconds_per_token: float | None = None  # the target's, from prompts longer than a catch-up
        self._step: dict[str, _StepDrafting] = {}  # method -> this step's drafting, until end_step

    def draft_cap(self, seqs: list[Sequence], wanted: list[int]) -> int:
        """The draft length every sequence of this batched step is held to (0: plain batching)."""
        for seq in seqs:
            self._estimate(seq).pending = capabilities.pending_tokens(seq.drafter, seq)
        rates = [self._rate(seqs, wanted, k) for k in range(max(wanted, default=0) + 1)]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))  # ties keep the shorter draft
        if best == 0 and len(rates) > 1:
            self.plain_steps += 1
            runner_up = max(range(1, len(rates)), key=lambda k: (rates[k], -k))
            # Draft once anyway when it comes close: the estimates may be stale. Not when it is far behind, and
            # never where a drafter would first catch up: that is dear, and it serves nothing while plain
            # batching goes on winning (4 requests 73 tokens behind: 1.5 s, 30 plain steps).
            if (self.plain_steps >= PROBE_EVERY and rates[runner_up] >= PROBE_MARGIN * rates[0]
                    and not any(self._estimate(seq).pending > CATCH_UP_TOKENS for seq in seqs)):
                best = runner_up
        if best > 0:
            self.plain_steps = 0
        return best

    def _rate(self, seqs: list[Sequence], wanted: list[int], k: int) -> float:
        """Expected committed tokens per second of a step drafting up to k tokens per sequence."""
        allowed = [min(k, w) for w in wanted]
        rows = len(seqs) * (1 + max(capabilities.max_nodes(seq.drafter, a) if a else 0 for seq, a in zip(seqs, allowed)))
        tokens, drafting = 0.0, 0.0
        for seq, a in zip(seqs, allowed):
            estimate = self._estimate(seq)
            tokens += sum(estimate.acceptance ** j for j in range(a + 1))
            drafting += a * (estimate.draft_seconds_per_token or 0.0) + (self._catch_up_share(seq, a) if a else 0.0)
        seconds = self.forward_estimate(rows) + drafting
        return tokens / seconds if seconds > 0 else float("inf")

    def _catch_up_share(self, seq: Sequence, k: int) -> float:
        """Seconds of the sequence's pending catch-up charged to a step drafting k tokens (0 when not behind)."""
        pending = self._estimate(seq).pending
        if pending <= CATCH_UP_TOKENS:
            return 0.0
        left = max(1, seq.sampling.max_tokens - seq.generated)
        per_token = self._method(seq).catch_up_seconds_per_token
        if per_token is None:  # never measured: no dearer than the target reading the tokens (0 before that)
            per_token = self.prefill_seconds_per_token or 0.0
        return min(1.0, (k + 1) / left) * pending * per_token

    def forward_estimate(self, rows: int) -> float:
        """Seconds of a target forward over `rows` rows, from the measured ones (0 before any)."""
        measured = sorted(self.forward_seconds)
        if not measured:
            return 0.0
        at = bisect.bisect_left(measured, rows)
        if at < len(measured) and measured[at] == rows:
            return self.forward_seconds[rows]
        if at == 0:  # fewer rows than ever measured: hopefully proportional
            return self.forward_seconds[measured[0]] * rows / measured[0]
        if at == len(measured):  # more rows than ever measured: on the last two's slope, or hopefully no dearer
            last = self.forward_seconds[measured[-1]]
            if len(measured) == 1:
                return last
            slope = (last - self.forward_seconds[measured[-2]]) / (measured[-1] - measured[-2])
            return last + max(slope, 0.0) * (rows - measured[-1])
        low, high = measured[at - 1], measured[at]
        share = (rows - low) / (high - low)
        return self.forward_seconds[low] + share * (self.forward_seconds[high] - self.forward_seconds[low])

    def observe_forward(self, rows: int, seconds: float) -> None:
        self.forward_seconds[rows] = _smoothed(self.forward_seconds.get(rows), seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The target's prefill of a prompt: what an unmeasured catch-up is priced at, per token (short prompts
        would overprice it: a forward's fixed costs shared among few tokens)."""
        if tokens > CATCH_UP_TOKENS:
            self.prefill_seconds_per_token = _smoothed(self.prefill_seconds_per_token, seconds / tokens)

    def observe_start(self, seq: Sequence, drafter_seconds: float) -> None:
        """After a request started: its drafter's prompt read, when it read one, prices its method's catch-ups
        until a catch-up itself is measured (a lone prompt read costs per token about what a batch's catch-ups
        do: one forward over many rows per request)."""
        restored = max((keys.shape[2] for keys, _ in seq.reused_drafter_rows.values()), default=0)
        read = len(seq.tokens) - capabilities.pending_tokens(seq.drafter, seq) - restored  # what the drafter read itself
        method = self._method(seq)
        if read > CATCH_UP_TOKENS and method.catch_up_seconds_per_token is None:
            method.catch_up_seconds_per_token = drafter_seconds / read

    def observe_sequence(self, seq: Sequence, budget: int, accepted: int, draft_seconds: float) -> None:
        """After a step (alone or batched) that let `seq` draft `budget` tokens, `accepted` of which the target
        kept. A proposal shorter than its budget (or none) counts as a rejection at its end: what the drafter
        failed to offer."""
        estimate = self._estimate(seq)
        pending, estimate.pending = estimate.pending, 0
        if budget == 0:
            return
        tried = accepted + (1 if accepted < budget else 0)
        for each in (estimate, self._method(seq)):
            each.accepted += accepted
            each.tried += tried
        step = self._step.setdefault(seq.spec.method, _StepDrafting())
        step.seconds += draft_seconds
        step.usual += budget * (estimate.draft_seconds_per_token or 0.0)
        # Tokens its drafter read this step: what it was behind, plus what the step committed, less what is left.
        read = pending + accepted + 1 - capabilities.pending_tokens(seq.drafter, seq) if pending > CATCH_UP_TOKENS else 0
        if read > CATCH_UP_TOKENS:
            step.caught_up += read
        else:
            step.per_token.append((estimate, draft_seconds / budget))

    def end_step(self) -> None:
        """After a step's `observe_sequence` calls: a method's catch-up cost from a step where some of its requests
        caught up (their drafting shares then say nothing of drafting's own cost), else each request's drafting
        cost per token, and its method's, which new requests start from."""
        for method, step in self._step.items():
            overall = self._methods[method]
            if step.caught_up:
                overall.catch_up_seconds_per_token = _smoothed(overall.catch_up_seconds_per_token,
                                                               max(0.0, step.seconds - step.usual) / step.caught_up)
                continue
            for estimate, per_token in step.per_token:
                estimate.draft_seconds_per_token = _smoothed(estimate.draft_seconds_per_token, per_token)
                overall.draft_seconds_per_token = _smoothed(overall.draft_seconds_per_token, per_token)
        self._step.clear()

    def _method(self, seq: Sequence) -> _Estimate:
        if seq.spec.method not in self._methods:
            self._methods[seq.spec.method] = _Estimate(FIRST_ACCEPTANCE, 1.0)
        return self._methods[seq.spec.method]

    def _estimate(self, seq: Sequence) -> _Estimate:
        if seq not in self._sequences:
            method = self._method(seq)
            self._sequences[seq] = _Estimate(method.acceptance * PRIOR_TRIED, PRIOR_TRIED,
                                             method.draft_seconds_per_token)
        return self._sequences[seq]


def _smoothed(known: float | None, newest: float) -> float:
    """A running estimate after its newest measurement (None: none before, the newest is taken as is)."""
    return newest if known is None else known + SMOOTHING * (newest - known)
