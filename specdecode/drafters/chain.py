"""Combinations such as 'ngram,draft' (llama.cpp's rule): the first member with a proposal wins the step.

Every member sees every request's start, commit and finish, so a model drafter's cache follows the tokens that
another member's draft got accepted; `result.source` tells each member whose proposal was verified.
"""

from __future__ import annotations

from specdecode.config import SpecConfig
from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources
from specdecode.drafters.registry import DRAFTERS, create_member, member_key, validate_method
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult


class ChainDrafter(Drafter):
    name = "chain"

    def __init__(self, members: list[Drafter]):
        self.members = members
        caps = [m.caps for m in members]
        self.caps = DrafterCaps(hidden_layers=tuple(sorted({i for c in caps for i in c.hidden_layers})),
                                final_hidden=any(c.final_hidden for c in caps),
                                emits_probs=any(c.emits_probs for c in caps),
                                emits_trees=any(c.emits_trees for c in caps),
                                needs_draft_model=any(c.needs_draft_model for c in caps))

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        for member in self.members:
            member.start(seq, prefill)

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        for member in self.members:
            proposal = member.propose(seq, budget)
            if proposal.size:
                return proposal
        return DraftProposal.empty(self.members[-1].name)

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        for member in self.members:
            member.commit(seq, result, target)

    def finish(self, seq: Sequence) -> None:
        for member in self.members:
            member.finish(seq)

    def max_nodes(self, budget: int) -> int:
        return max(member.max_nodes(budget) for member in self.members)

    def cache_bytes(self) -> int:
        return sum(member.cache_bytes() for member in self.members)


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
    return chosen[0] if len(chosen) == 1 else ChainDrafter(chosen)
