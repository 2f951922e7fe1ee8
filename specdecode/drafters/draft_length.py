"""How many tokens to draft next: fixed, or adapted to how well recent drafts were accepted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from specdecode.drafters import capabilities

if TYPE_CHECKING:
    from specdecode.config import SpecConfig
    from specdecode.drafters.base import Drafter


class DraftLength:
    """Grows by one after a fully accepted draft and shrinks by one after a rejection, within [1, 2 * initial].

    Close to transformers' candidate-generator heuristic (+2 / -1); symmetric steps keep the length from
    overshooting when acceptance hovers around the point where one more drafted token stops paying.
    """

    def __init__(self, initial: int, adaptive: bool):
        self.current = initial
        self.initial = initial
        self.adaptive = adaptive and initial > 0
        self.maximum = 2 * initial

    @classmethod
    def offered(cls, initial: int, adaptive: bool) -> DraftLength:
        """The most a DraftLength(initial, adaptive) can reach, fixed: for a drafter that adapts its members'
        lengths itself (capabilities.Composite.adapts_lengths), which each keep their own within it."""
        length = cls(initial, adaptive)
        length.current = length.maximum if length.adaptive else initial
        length.adaptive = False
        return length

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        if accepted == drafted:
            self.current = min(self.current + 1, self.maximum)
        else:
            self.current = max(1, self.current - 1)

    def regain(self) -> None:
        """A step its drafter sat out (per-step choice chose another member, or no draft): a length its rejections
        cut below the initial one grows back by one. Under per-step choice a member is priced at its own length, and
        only a draft it makes can lengthen it, so a draft model cut to 1 token promised no more than suffix's 1-token
        proposals and stayed cut while they ran (#62, a fresh process per answer, humanities: 25 suffix steps of 1.6
        tokens, 10 in a row, where the draft model ran 2.5 a step)."""
        if self.adaptive and self.current < self.initial:
            self.current += 1


def draft_length_for(drafter: Drafter, spec: SpecConfig) -> DraftLength:
    """A request's draft length: a block drafter's block (cut by the token budget only); the most a combination
    that keeps each member's own length is offered (per-step choice: combination.py); else the spec's."""
    block = drafter.caps.block_size
    if block:
        return DraftLength(block - 1, False)
    if capabilities.adapts_lengths(drafter):
        return DraftLength.offered(spec.num_draft_tokens, spec.adaptive)
    return DraftLength(spec.num_draft_tokens, spec.adaptive)


def proposed_nodes(drafter: Drafter, spec: SpecConfig) -> int:
    """The most nodes one step's proposal can hold: cache room a request keeps until the rejected ones are dropped."""
    return capabilities.max_nodes(drafter, draft_length_for(drafter, spec).maximum)


def rollback_rows(drafter: Drafter, spec: SpecConfig) -> int:
    """The rows a verify forward may roll back over (root and proposed nodes): a hybrid trunk keeps each one's
    recurrent states until the step commits."""
    return proposed_nodes(drafter, spec) + 1
