"""Combinations such as 'ngram,draft'. combine="first" is llama.cpp's rule: the first member with a proposal
wins the step. combine="best" asks the members' estimates which one promises the most tokens per second
(step_choice.py).

Every member sees every request's start, commit and finish, so a model drafter's cache follows the tokens that
another member's draft got accepted; `result.source` tells each member whose proposal was verified.
"""

from __future__ import annotations

from time import perf_counter

from specdecode.config import SpecConfig
from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources
from specdecode.drafters.registry import DRAFTERS, create_member, member_key, validate_method
from specdecode.drafters.step_choice import StepChooser
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult
from specdecode.tree import proposal_depth


DEFERRED = "chain.deferred"  # seq.drafter_state: the members whose start waits for their first turn


class ChainDrafter(Drafter):
    name = "chain"
    clock = staticmethod(perf_counter)  # tests script it

    def __init__(self, members: list[Drafter], combine: str = "first"):
        self.members = members
        self.chooser = StepChooser([m.name for m in members]) if combine == "best" else None
        caps = [m.caps for m in members]
        self.caps = DrafterCaps(hidden_layers=tuple(sorted({i for c in caps for i in c.hidden_layers})),
                                final_hidden=any(c.final_hidden for c in caps),
                                emits_probs=any(c.emits_probs for c in caps),
                                emits_trees=any(c.emits_trees for c in caps),
                                needs_draft_model=any(c.needs_draft_model for c in caps),
                                draft_files=any(c.draft_files for c in caps))

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        """Every member starts, except that per-step choice defers those that can (a draft model's prompt
        forward) until first chosen: a request the lookups serve alone never pays for them."""
        deferred = set()
        for member in self.members:
            if self.chooser is not None and member.defer_start(seq):
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
        proposal = self._best(seq, budget)
        seq.drafter_state[self.name] = (self.clock(), proposal_depth(proposal), proposal.size)
        return proposal

    def propose_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """First wins, member by member over the whole batch, so that a member whose forwards batch (the draft
        model) drafts for every request the earlier members left without a proposal at once."""
        if self.chooser is not None:
            return super().propose_many(seqs, budgets)
        proposals = [DraftProposal.empty(self.members[-1].name) for _ in seqs]
        waiting = [i for i, budget in enumerate(budgets) if budget > 0]
        for member in self.members:
            if not waiting:
                break
            offered = member.propose_many([seqs[i] for i in waiting], [budgets[i] for i in waiting])
            for i, proposal in zip(waiting, offered):
                if proposal.size:
                    proposals[i] = proposal
            waiting = [i for i, proposal in zip(waiting, offered) if not proposal.size]
        return proposals

    def _best(self, seq: Sequence, budget: int) -> DraftProposal:
        """Deterministic members propose now (judged on their proposal); sampling members are judged on their
        estimates and asked only if chosen, so their random drafts never influence whether they are used."""
        candidates = []  # (promise in tokens/s, member, its proposal or None = not asked yet)
        for member in self.members:
            if member.caps.emits_probs:
                seconds = self.chooser.drafting_seconds(member.name, budget) + self._start_share(member, seq, budget)
                candidates.append((self.chooser.promise(member.name, budget, budget, seconds), member, None))
                continue
            proposal = self._timed_propose(member, seq, budget)
            if proposal.size:
                if self.chooser.needs_evidence(member.name):
                    return proposal  # free to make: learn what it is worth (step_choice.py)
                promise = self.chooser.promise(member.name, proposal_depth(proposal), proposal.size, 0.0)
                candidates.append((promise, member, proposal))
        plain = self.chooser.plain_promise()
        for promise, member, proposal in sorted(candidates, key=lambda c: -c[0]):
            if promise < plain:
                return DraftProposal.empty(self.members[-1].name, withheld="chooser_plain")
            proposal = proposal if proposal is not None else self._timed_propose(member, seq, budget)
            if proposal.size:
                return proposal
        return DraftProposal.empty(self.members[-1].name)

    def _start_share(self, member: Drafter, seq: Sequence, budget: int) -> float:
        """The part of a deferred member's first catch-up charged to a step drafting `budget` tokens: the
        catch-up serves every later step of the request, so a step pays (budget + 1) / tokens left of it."""
        if member.name not in seq.drafter_state.get(DEFERRED, ()):
            return 0.0
        left = max(1, seq.sampling.max_tokens - seq.generated)
        share = min(1.0, (budget + 1) / left)
        return share * self.chooser.start_seconds(member.name, member.pending_tokens(seq))

    def _timed_propose(self, member: Drafter, seq: Sequence, budget: int) -> DraftProposal:
        deferred = seq.drafter_state.get(DEFERRED, ())
        starting = member.name in deferred
        context = member.pending_tokens(seq) if starting else 0
        began = self.clock()
        proposal = member.propose(seq, budget)
        seconds = self.clock() - began
        if starting:
            deferred.remove(member.name)
            self.chooser.record_start(member.name, seconds, context, proposal.size)
        else:
            self.chooser.record_drafting(member.name, seconds, proposal.size)
        return proposal

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        if self.chooser is not None:
            proposed = seq.drafter_state.pop(self.name, None)  # None: the engine had no room to ask for drafts
            if proposed is not None:
                proposed_at, depth, nodes = proposed
                self.chooser.record_verdict(result.source, depth, result.num_accepted, nodes,
                                            self.clock() - proposed_at)
        for member in self.members:
            member.commit(seq, result, target)

    def finish(self, seq: Sequence) -> None:
        seq.drafter_state.pop(self.name, None)
        seq.drafter_state.pop(DEFERRED, None)
        for member in self.members:
            member.finish(seq)

    def max_nodes(self, budget: int) -> int:
        return max(member.max_nodes(budget) for member in self.members)

    def cache_bytes(self) -> int:
        return sum(member.cache_bytes() for member in self.members)

    def weights_bytes(self) -> int:
        return sum(member.weights_bytes() for member in self.members)

    def request_bytes(self, seq: Sequence) -> int:
        return sum(member.request_bytes(seq) for member in self.members)


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
    return chosen[0] if len(chosen) == 1 else ChainDrafter(chosen, spec.combine)
