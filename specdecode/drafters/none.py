"""Plain decoding through the same engine: the baseline every method is measured against."""

from specdecode.drafters.base import DraftProposal, Drafter, SequenceState, register


@register
class NoDrafter(Drafter):
    name = "none"

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        return DraftProposal.empty(self.name)
