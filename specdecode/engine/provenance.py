"""Where each committed token came from, for a request that asks (`Engine.begin(..., provenance=True)`): the live
view in `specdecode serve`, `generate --show-drafts` and `generate --json` read it.

Every step commits its accepted drafts and one token of the target's own. Terms as in acceptance/verify.py:
- "draft": an accepted drafted token, with the method that proposed it and its position in the draft (1-based);
- "corrected": the target's token after a rejected draft (the recovered token);
- "bonus": the target's token after every token of the path was accepted (the step drafted and lost nothing);
- "target": the target's token of a step that drafted nothing (plain decoding, the prefill's first token).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from specdecode.acceptance.tree import children_of
from specdecode.spec_types import DraftProposal, VerifyResult


@dataclass(frozen=True)
class TokenOrigin:
    kind: str  # "draft", "corrected", "bonus" or "target"
    method: str | None = None  # the drafter that proposed it ("draft" only)
    position: int | None = None  # its depth in the draft, 1-based ("draft" only)
    step: int = 0  # the request's step that committed it (0: the prefill)


@dataclass(frozen=True)
class StepTrace:
    """One step of one request: what was drafted and what the target kept."""

    step: int
    method: str  # the drafter whose proposal was verified ("" when none drafted)
    drafted: list[int]  # the proposed tokens, in node order
    parents: list[int] | None  # each node's parent (-1: the last committed token); None: a chain
    accepted: int  # drafted tokens kept
    seconds: float  # the step's wall time, drafting and the verify forward

    def to_dict(self) -> dict:
        return asdict(self)


def origins(proposal: DraftProposal, result: VerifyResult, step: int) -> list[TokenOrigin]:
    """The origin of each token `result` commits: its accepted nodes, then the target's own."""
    kept = [TokenOrigin("draft", proposal.source, depth, step) for depth in range(1, result.num_accepted + 1)]
    if proposal.size == 0:
        last = "target"
    else:
        children = children_of(proposal.parent_list())
        leaf_row = result.path[-1] + 1 if result.path else 0  # row 0: the root
        last = "bonus" if not children[leaf_row] else "corrected"
    return kept + [TokenOrigin(last, step=step)]
