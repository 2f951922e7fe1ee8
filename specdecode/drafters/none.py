"""Plain decoding through the same engine: the baseline every method is measured against."""

from specdecode.drafters.base import Drafter, DrafterCaps
from specdecode.drafters.registry import register
from specdecode.spec_types import DraftProposal, Sequence


@register
class NoDrafter(Drafter):
    name = "none"
    caps = DrafterCaps(drafts=False)

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        return DraftProposal.empty(self.name)
