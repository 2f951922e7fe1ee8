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
        for member in self.members:
            member.start(seq, prefill)

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
                seconds = self.chooser.drafting_seconds(member.name, budget)
                candidates.append((self.chooser.promise(member.name, budget, budget, seconds), member, None))
                continue
            proposal = self._timed_propose(member, seq, budget)
            if proposal.size:
                promise = self.chooser.promise(member.name, proposal_depth(proposal), proposal.size, 0.0)
                candidates.append((promise, member, proposal))
        for _, member, proposal in sorted(candidates, key=lambda c: -c[0]):
            proposal = proposal if proposal is not None else self._timed_propose(member, seq, budget)
            if proposal.size:
                return proposal
        return DraftProposal.empty(self.members[-1].name)

    def _timed_propose(self, member: Drafter, seq: Sequence, budget: int) -> DraftProposal:
        began = self.clock()
        proposal = member.propose(seq, budget)
        self.chooser.record_drafting(member.name, self.clock() - began, proposal.size)
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
