"""Combinations such as 'ngram,draft'. combine="first" is llama.cpp's rule: the first member with a proposal
wins the step. combine="best" asks the members' estimates which one promises the most tokens per second
(step_choice.py).

Every member sees every request's start, commit and finish, so a model drafter's cache follows the tokens that
another member's draft got accepted; `result.source` tells each member whose proposal was verified.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from time import perf_counter
from typing import TYPE_CHECKING

from specdecode.acceptance.tree import proposal_depth
from specdecode.config import SpecConfig
from specdecode.drafters import capabilities
from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources
from specdecode.drafters.capabilities import Batching, Composite, MemorySizing, ReadsVerifyRows
from specdecode.drafters.draft_length import DraftLength
from specdecode.drafters.registry import DRAFTERS, create_member, member_key, validate_method
from specdecode.drafters.step_choice import StepChooser, WarmMeasure, rate
from specdecode.models.decoder.moe import ExpertTally
from specdecode.spec_types import ChoiceRecord, DraftProposal, Sequence, TargetOutput, VerifyResult

if TYPE_CHECKING:
    import torch

    from specdecode.models.decoder.kv_cache import KVCache


DEFERRED = "combination.deferred"  # seq.drafter_state: the members whose start waits for their first turn
# A member with more committed tokens than this to read before it can propose has fallen behind (the steps other
# members or plain decoding ran while it was not chosen) and catches up as a deferred start does. Measured before
# (#62: a fresh process per answer, coding): the draft model chosen after 232 tokens of suffix steps took 327 ms for
# one drafted token, and timed as drafting that priced it out of the rest of the request. As load_budget.py's
# CATCH_UP_TOKENS: above a probe's reading of what a run of plain steps committed.
LAGGING_TOKENS = 32
# The fewest tokens a request is taken to have left, for pricing a catch-up (`_catch_up_share`): as many as it has
# generated, since an answer that has run long tends to run on, and at first this many; or where the engine's
# earlier answers ran longer, up to their typical length (StepChooser.answer_tokens).
ANSWER_FLOOR = 32
LENGTHS = "combination.lengths"  # seq.drafter_state: per-step choice's draft length per member
PLAIN = "plain"  # the choice's name for a step it ran without drafts (seq.choices)


class CombinationDrafter(Drafter, Batching, Composite, MemorySizing, ReadsVerifyRows):
    """Not registered: build_drafter makes one for a spec that names several methods."""

    name = "combination"
    clock = staticmethod(perf_counter)  # tests script it

    def __init__(self, members: list[Drafter], combine: str = "first", tally: ExpertTally | None = None,
                 warm_measures: Mapping[str, WarmMeasure] | None = None):
        """tally: the target's count of the experts its forwards read, where it has experts (verify_cost.py);
        warm_measures: what the Engine's warm-up measured of the members (DrafterResources.warm_measures)."""
        self.members = members
        self.chooser = StepChooser([m.name for m in members], tally, warm_measures) if combine == "best" else None
        caps = [m.caps for m in members]
        self.caps = DrafterCaps(hidden_layers=tuple(sorted({i for c in caps for i in c.hidden_layers})),
                                final_hidden=any(c.final_hidden for c in caps),
                                emits_probs=any(c.emits_probs for c in caps),
                                emits_trees=any(c.emits_trees for c in caps),
                                needs_draft_model=any(c.needs_draft_model for c in caps),
                                draft_files=any(c.draft_files for c in caps))

    @classmethod
    def create(cls, resources: DrafterResources, options) -> Drafter:
        raise TypeError("a combination is built from its members by build_drafter, not created from options")

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        """Every member starts, except that per-step choice defers those that can (a draft model's prompt
        forward) until first chosen: a request the lookups serve alone never pays for them."""
        deferred = set()
        if self.chooser is not None:
            seq.drafter_state[LENGTHS] = {member.name: DraftLength(seq.spec.num_draft_tokens, seq.spec.adaptive)
                                          for member in self.members}
        for member in self.members:
            if self.chooser is not None and capabilities.defers_start(member):
                member.defer_start(seq)
                deferred.add(member.name)
            else:
                member.start(seq, prefill)
        if deferred:
            seq.drafter_state[DEFERRED] = deferred

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        if self.chooser is None:
            for member in self.members:
                proposal = member.propose(seq, budget)
                if proposal.size:
                    return proposal
            return DraftProposal.empty(self.members[-1].name)
        return self._best_many([seq], [budget])[0]

    def propose_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """First wins, member by member over the whole batch, so that a member whose forwards batch (the draft
        model) drafts for every request the earlier members left without a proposal at once. Best: each request
        chooses its member as alone, and the requests that chose one model member draft together."""
        if self.chooser is not None:
            return self.proposals_for_asked(seqs, budgets, self._best_many)
        proposals = [DraftProposal.empty(self.members[-1].name) for _ in seqs]
        waiting = [i for i, budget in enumerate(budgets) if budget > 0]
        for member in self.members:
            if not waiting:
                break
            offered = capabilities.propose_many(member, [seqs[i] for i in waiting], [budgets[i] for i in waiting])
            for i, proposal in zip(waiting, offered):
                if proposal.size:
                    proposals[i] = proposal
            waiting = [i for i, proposal in zip(waiting, offered) if not proposal.size]
        return proposals

    def _best_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """Each request's best member (`_ranked`); the requests whose choice is the same sampling member are asked
        together, and one whose choice proposes nothing goes on down its own ranking. Each request keeps what its
        choice promised (name, expected tokens, expected seconds), for the record `commit` adds to seq.choices."""
        began = self.clock()
        proposals: list[DraftProposal | None] = [None] * len(seqs)
        promised: list[tuple[str, float, float] | None] = [None] * len(seqs)
        rankings: dict[int, list[Candidate]] = {}
        # A drafter alone under the choice (a mixture of experts' target: build_drafter) drafts every step for a
        # request that turned the guard off, as it would without the choice.
        unguarded = [i for i, seq in enumerate(seqs) if len(self.members) == 1 and not seq.spec.guard]
        if unguarded:
            member = self.members[0]
            for i, proposal in zip(unguarded, self._timed_propose_many(
                    member, [seqs[i] for i in unguarded],
                    [min(budgets[i], seqs[i].drafter_state[LENGTHS][member.name].current) for i in unguarded])):
                proposals[i] = proposal
        for i, (seq, budget) in enumerate(zip(seqs, budgets)):
            if proposals[i] is not None:
                continue
            outright, ranking = self._ranked(seq, budget)
            if outright is None:
                rankings[i] = ranking
            else:
                proposals[i], promised[i] = outright.proposal, (outright.member.name, *outright.expected)
        plain = self.chooser.plain_promise()
        while rankings:
            asks: dict[str, list[int]] = {}  # member name -> the requests whose best untried choice it is
            for i, ranking in list(rankings.items()):
                if ranking and ranking[0].promise >= plain and ranking[0].proposal is None:
                    asks.setdefault(ranking[0].member.name, []).append(i)
                    continue
                if not ranking:
                    proposals[i] = DraftProposal.empty(self.members[-1].name)
                elif ranking[0].promise < plain:
                    proposals[i] = DraftProposal.empty(self.members[-1].name, withheld="chooser_plain")
                    promised[i] = (PLAIN, 1.0, self.chooser.verify_seconds(0))
                else:
                    proposals[i] = ranking[0].proposal  # a lookup's proposal, made while ranking
                    promised[i] = (ranking[0].member.name, *ranking[0].expected)
                del rankings[i]
            for group in asks.values():
                chosen = rankings[group[0]][0]
                for i, proposal in zip(group, self._timed_propose_many(chosen.member, [seqs[i] for i in group],
                                                                        [rankings[i][0].depth for i in group])):
                    if proposal.size:
                        proposals[i], promised[i] = proposal, (chosen.member.name, *rankings[i][0].expected)
                        del rankings[i]
                    else:
                        rankings[i].pop(0)
        stamp = self.clock()  # the verify forward starts after every proposal of the step
        for seq, proposal, choice in zip(seqs, proposals, promised):
            seq.drafter_state[self.name] = (began, stamp, proposal_depth(proposal), proposal.size, choice)
        return proposals

    def _ranked(self, seq: Sequence, budget: int) -> tuple[Candidate | None, list[Candidate]]:
        """Deterministic members propose now (judged on their proposal); sampling members are judged on their
        estimates and asked only if chosen, so their random drafts never influence whether they are used.
        -> (a lookup's proposal to use outright, or None; the candidates by promise in tokens/s, best first,
        each with its proposal or None = not asked yet)."""
        candidates, tries = [], []
        lengths = seq.drafter_state[LENGTHS]
        for member in self.members:
            # Each member's own adapted length within the step's budget (the engine offers the most: adapts_lengths).
            budget_for = min(budget, lengths[member.name].current)
            if member.caps.emits_probs:
                # Priced by the most nodes its proposal may hold (a tree's node budget; a chain's depth): each is
                # drafted, and verified as a row of its own.
                def nodes(depth: int, member: Drafter = member) -> int:
                    return capabilities.max_nodes(member, depth)

                def seconds(depth: int, member: Drafter = member) -> float:
                    return (self.chooser.drafting_seconds(member.name, nodes(depth))
                            + self._catch_up_share(member, seq, depth))

                depth = self.chooser.best_depth(member.name, budget_for, nodes, seconds)
                candidates.append(Candidate(member, None, self.chooser.expected(member.name, depth, nodes(depth),
                                                                                 seconds(depth)), depth))
                continue
            proposal = self._timed_propose_many(member, [seq], [budget_for])[0]
            if proposal.size:
                candidate = Candidate(member, proposal, self.chooser.expected_lookup(
                    member.name, proposal_depth(proposal), proposal.size))
                (tries if self.chooser.needs_evidence(member.name) else candidates).append(candidate)
        ranking = sorted(candidates, key=lambda c: -c.promise)
        # A lookup with too little evidence is tried, free to make, to learn what it is worth (step_choice.py);
        # only where its proposal, every token accepted, would beat the best candidate and a plain step: one that
        # could not win costs the step what the best would have given, and cannot show the lookup worth choosing
        # (#62: a fresh process's first request tried suffix's 1-token proposals in place of the draft model's).
        bar = max([self.chooser.plain_promise(), *(c.promise for c in ranking[:1])])
        for candidate in tries:
            if rate(proposal_depth(candidate.proposal) + 1, candidate.expected[1]) >= bar:
                return candidate, []
        return None, sorted(ranking + tries, key=lambda c: -c.promise)

    @staticmethod
    def _catching_up(member: Drafter, seq: Sequence) -> bool:
        """Whether `member` must first read a context it has not seen: its deferred start, or more than
        LAGGING_TOKENS committed while it was not chosen."""
        return (member.name in seq.drafter_state.get(DEFERRED, ())
                or capabilities.pending_tokens(member, seq) > LAGGING_TOKENS)

    def _catch_up_share(self, member: Drafter, seq: Sequence, budget: int) -> float:
        """The part of a member's catch-up (`_catching_up`) charged to a step drafting `budget` tokens: the
        catch-up serves every later step of the request, so a step pays (budget + 1) / tokens left of it. Where an
        answer ends is unknown: tokens left are taken as many as it has (at least ANSWER_FLOOR), or what the
        engine's earlier answers had on average still to go, whichever is more, within max_tokens. Counted to
        max_tokens, a 40-token answer to a 441-token prompt started the draft model for 6 steps (#62: a fresh
        process per answer); counted from the answer alone, a second turn's 256-token answer (one long-lived
        process, roleplay) ran 60 steps of losing lookups and plain steps before the draft model caught up on its
        283-token context."""
        if not self._catching_up(member, seq):
            return 0.0
        usual = self.chooser.answer_tokens - seq.generated
        left = max(1, min(seq.sampling.max_tokens - seq.generated, max(seq.generated, ANSWER_FLOOR, usual)))
        share = min(1.0, (budget + 1) / left)
        return share * self.chooser.start_seconds(member.name, capabilities.pending_tokens(member, seq),
                                                  seq.target_prefill_seconds_per_token)

    def _timed_propose_many(self, member: Drafter, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """member's proposals, timed into the chooser's estimates: a request where the member catches up (its
        deferred start, or a context it fell behind on: `_catching_up`, timed apart as a start) alone, the others
        in one propose_many."""
        proposals: list[DraftProposal | None] = [None] * len(seqs)
        going = []
        for i, seq in enumerate(seqs):
            if not self._catching_up(member, seq):
                going.append(i)
                continue
            context = capabilities.pending_tokens(member, seq)
            began = self.clock()
            proposals[i] = replace(member.propose(seq, budgets[i]), caught_up=True)
            seq.drafter_state.get(DEFERRED, set()).discard(member.name)
            self.chooser.record_start(member.name, self.clock() - began, context, proposals[i].size)
        if going:
            began = self.clock()
            offered = capabilities.propose_many(member, [seqs[i] for i in going], [budgets[i] for i in going])
            self.chooser.record_drafting(member.name, self.clock() - began, sum(p.size for p in offered))
            for i, proposal in zip(going, offered):
                proposals[i] = proposal
        return proposals

    def observe(self, seq: Sequence, fed: torch.Tensor, target: TargetOutput) -> None:
        for member in self.members:
            capabilities.observe(member, seq, fed, target)

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        if self.chooser is not None:
            proposed = seq.drafter_state.pop(self.name, None)  # None: the engine had no room to ask for drafts
            if proposed is not None:
                began, proposed_at, depth, nodes, choice = proposed
                now = self.clock()
                self.chooser.record_verdict(result.source, depth, result.num_accepted, nodes, now - proposed_at)
                lengths = seq.drafter_state[LENGTHS]
                if result.source in lengths:
                    lengths[result.source].update(depth, result.num_accepted)  # its own length, whoever else drafts
                for member in self.members:
                    # A member judged on its estimates (a sampling one) regains a cut length while it sits out.
                    if member.caps.emits_probs and (member.name != result.source or depth == 0):
                        lengths[member.name].regain()
                if choice is not None:
                    name, tokens, seconds = choice
                    seq.choices.setdefault(name, ChoiceRecord()).add(tokens, seconds, len(result.tokens),
                                                                     now - began, depth)
        for member in self.members:
            member.commit(seq, result, target)

    def finish(self, seq: Sequence) -> None:
        if self.chooser is not None:
            self.chooser.record_answer(seq.generated)
        seq.drafter_state.pop(self.name, None)
        seq.drafter_state.pop(DEFERRED, None)
        seq.drafter_state.pop(LENGTHS, None)
        for member in self.members:
            member.finish(seq)

    def parts(self) -> list[Drafter]:
        return list(self.members)

    def adapts_lengths(self) -> bool:
        return self.chooser is not None  # per-step choice: each member's own length (LENGTHS)

    def max_nodes(self, budget: int) -> int:
        return max(capabilities.max_nodes(member, budget) for member in self.members)

    def token_caches(self, seq: Sequence) -> dict[str, KVCache]:
        return {name: cache for member in self.members
                for name, cache in capabilities.token_caches(member, seq).items()}

    def cache_bytes(self) -> int:
        return sum(capabilities.cache_bytes(member) for member in self.members)

    def weights_bytes(self) -> int:
        return sum(capabilities.weights_bytes(member) for member in self.members)

    def request_bytes(self, seq: Sequence) -> int:
        return sum(capabilities.request_bytes(member, seq) for member in self.members)


@dataclass(frozen=True)
class Candidate:
    """One member's bid for a step: its proposal (None: a sampling member not asked yet) and what the chooser
    expects of it, (committed tokens, seconds)."""

    member: Drafter
    proposal: DraftProposal | None
    expected: tuple[float, float]
    depth: int = 0  # how deep to ask a sampling member to draft (StepChooser.best_depth); 0 for a lookup's

    @property
    def promise(self) -> float:
        """Committed tokens per second."""
        return rate(*self.expected)


def build_drafter(spec: SpecConfig, resources: DrafterResources, members: dict[tuple, Drafter]) -> Drafter:
    """The drafter for `spec`, its members taken from (or added to) `members`, so that each distinct drafter
    is created once per Engine whatever combinations it serves in."""
    chosen = []
    for name in validate_method(spec):
        cls = DRAFTERS[name]
        key = member_key(cls, spec)
        if key not in members:
            members[key] = create_member(cls, spec, resources)
        chosen.append(members[key])
    tally = ExpertTally.of(resources.target.model)
    if len(chosen) == 1 and tally is None:
        return chosen[0]
    # On a mixture of experts one drafter alone runs under per-step choice too (a request with --no-guard drafts
    # every step): each drafted row can add experts for the verify forward to read, so a draft must promise more
    # than a plain step before it is made (verify_cost.py). The speed guard judges windows of steps already run:
    # where a draft costs as much as a MoE's (an MTP layer is a whole sparse layer and the head) that comes late.
    return CombinationDrafter(chosen, spec.combine if len(chosen) > 1 else "best", tally, resources.warm_measures)
