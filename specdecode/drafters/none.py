"""Plain decoding through the same engine: the baseline every method is measured against."""

from __future__ import annotations

from specdecode.drafters.base import Drafter, DrafterCaps, DrafterResources
from specdecode.drafters.registry import register
from specdecode.spec_types import DraftProposal, Sequence


@register
class NoDrafter(Drafter):
    name = "none"
    caps = DrafterCaps(drafts=False)

    @classmethod
    def create(cls, resources: DrafterResources, options) -> NoDrafter:
        return cls()

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        return DraftProposal.empty(self.name)
