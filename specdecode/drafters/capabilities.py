"""Optional capabilities a drafter class declares by inheriting them, each with what a drafter that does not
declare it gets instead.

The core (base.py) is the request's lifecycle: create, start, propose, commit, finish. Everything else is one of
these, so a new drafter writes only what it has:

- `Batching`: proposals for several requests from shared forwards (`propose_many`); without it, one `propose` per
  request.
- `MemorySizing`: how many nodes a proposal may hold (the KV cache keeps room for them), the memory its weights,
  caches and per-request state hold, and the KV caches of committed tokens it keeps (the prefix cache stores
  them); without it, a proposal holds at most its budget and nothing is counted.
- `DeferredStart`: it can begin a request without reading the prefill, catching up on its first proposal (a draft
  model), so a combination that may never choose it never pays for it; without it, every request starts at once.
- `ReadsVerifyRows`: it reads every row of each verify forward, the rejected drafts' included (`observe`).
- `AutoMember`: `auto` may run it (`auto_rank`), and what makes it usable with what was loaded (`found_for`).
- `StandsForOthers`: it drafts nothing itself but stands for other drafters (`auto`); `Composite`: it is made of
  other drafters (a combination), which the Engine keeps once each.

The engine and the combination reach them through the functions below, never by asking which method runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from specdecode.drafters.base import Drafter, DrafterResources
from specdecode.errors import SpecDecodeError
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput

if TYPE_CHECKING:
    import torch

    from specdecode.models.decoder.kv_cache import KVCache

ProposeChains = Callable[[list[Sequence], list[int]], list[DraftProposal]]


class Batching:
    """A drafter whose forwards batch without changing a bit: `propose_many` gives each request what `propose`
    gives it alone."""

    def propose_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """Proposals for the requests of one batched step (a budget of 0: nothing)."""
        return one_by_one(self, seqs, budgets)

    def proposals_for_asked(self, seqs: list[Sequence], budgets: list[int], chains: ProposeChains) -> list[DraftProposal]:
        """`chains(seqs, budgets)` over the sequences asked for tokens (a budget above 0), empty proposals for the
        rest (a chain whose earlier member drafted for them)."""
        proposals = [DraftProposal.empty(self.name) for _ in seqs]
        asked = [b for b, budget in enumerate(budgets) if budget > 0]
        if asked:
            for b, chain in zip(asked, chains([seqs[b] for b in asked], [budgets[b] for b in asked])):
                proposals[b] = chain
        return proposals


class MemorySizing:
    """What a drafter's proposals and memory need, for the KV cache's room and the memory reports."""

    def max_nodes(self, budget: int) -> int:
        """The most nodes a proposal under `budget` may hold (the KV cache keeps room for them)."""
        return budget

    def token_caches(self, seq: Sequence) -> dict[str, KVCache]:
        """KV caches this drafter keeps of the request's committed tokens, by drafter name (a draft model's; row i
        holds seq.tokens[i]): the prefix cache keeps their rows with the target's, and a later request that
        reuses them finds them in `seq.reused_drafter_rows` as it starts."""
        return {}

    def cache_bytes(self) -> int:
        """Memory held by caches that outlive a request (reported in stats; weights are not counted)."""
        return 0

    def weights_bytes(self) -> int:
        """Memory held by weights of the drafter's own (an EAGLE-3 head); a draft model's are the Engine's."""
        return 0

    def request_bytes(self, seq: Sequence) -> int:
        """Memory this request's state holds in the drafter (a draft model's KV cache), while it runs."""
        return 0


class DeferredStart(ABC):
    """A drafter that can begin a request without reading the prefill: its first proposal catches up."""

    @abstractmethod
    def defer_start(self, seq: Sequence) -> None:
        """Begin the request without reading the prefill (`start` would read it)."""

    @abstractmethod
    def pending_tokens(self, seq: Sequence) -> int:
        """Committed tokens this drafter has yet to read before it can propose (its catch-up)."""


class ReadsVerifyRows(ABC):
    """A drafter that learns from every row of each verify forward, the rejected drafts' included."""

    @abstractmethod
    def observe(self, seq: Sequence, fed: torch.Tensor, target: TargetOutput) -> None:
        """Before `commit`: `fed` [T] the tokens fed (the root, then each proposed node), `target` their rows
        (logits of each)."""


class AutoMember:
    """A drafter `auto` may run (drafters/auto.py), tried in `auto_rank` order, lower first."""

    auto_rank: ClassVar[int]

    @classmethod
    def found_for(cls, resources: DrafterResources) -> str | None:
        """What makes this drafter usable with what was loaded, in a few words, or None when it cannot draft here."""
        try:
            cls.check_resources(resources)
        except SpecDecodeError:
            return None
        if cls.caps.draft_files:
            return f"{cls.weights_kind} at {resources.path_for(cls.name)}"
        if cls.caps.needs_draft_model:
            return f"draft model {resources.draft.name}"
        return "free to run"


class StandsForOthers(ABC):
    """A registered name that drafts nothing itself: the Engine runs the drafters it stands for (`auto`)."""

    finds_sources: ClassVar[bool] = False  # it decides what to load before models load (auto.find_sources)

    @classmethod
    @abstractmethod
    def stands_for(cls, resources: DrafterResources) -> list[str]:
        """The drafters it stands for with these resources, by name."""


class Composite(ABC):
    """A drafter made of others (a combination); the Engine keeps each of them once."""

    @abstractmethod
    def parts(self) -> list[Drafter]:
        """The drafters it is made of."""

    def adapts_lengths(self) -> bool:
        """Whether it adapts each part's draft length itself (per-step choice: one member's rejections must not
        shorten another's drafts); the Engine then offers it the most the request's length could reach."""
        return False


def one_by_one(drafter: Drafter, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
    """Each request's own `propose` (a budget of 0: nothing)."""
    return [drafter.propose(seq, budget) if budget > 0 else DraftProposal.empty(drafter.name)
            for seq, budget in zip(seqs, budgets)]


def propose_many(drafter: Drafter, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
    """The proposals for one batched step: shared forwards where the drafter batches, else one by one."""
    if isinstance(drafter, Batching):
        return drafter.propose_many(seqs, budgets)
    return one_by_one(drafter, seqs, budgets)


def max_nodes(drafter: Drafter, budget: int) -> int:
    return drafter.max_nodes(budget) if isinstance(drafter, MemorySizing) else budget


def token_caches(drafter: Drafter, seq: Sequence) -> dict[str, KVCache]:
    return drafter.token_caches(seq) if isinstance(drafter, MemorySizing) else {}


def cache_bytes(drafter: Drafter) -> int:
    return drafter.cache_bytes() if isinstance(drafter, MemorySizing) else 0


def weights_bytes(drafter: Drafter) -> int:
    return drafter.weights_bytes() if isinstance(drafter, MemorySizing) else 0


def request_bytes(drafter: Drafter, seq: Sequence) -> int:
    return drafter.request_bytes(seq) if isinstance(drafter, MemorySizing) else 0


def defers_start(drafter: Drafter) -> bool:
    return isinstance(drafter, DeferredStart)


def pending_tokens(drafter: Drafter, seq: Sequence) -> int:
    """Committed tokens a drafter has yet to read before it can propose; for a combination, the most any member
    has (what a step that falls to that member catches up on)."""
    if isinstance(drafter, Composite):
        return max(pending_tokens(part, seq) for part in drafter.parts())
    return drafter.pending_tokens(seq) if isinstance(drafter, DeferredStart) else 0


def observe(drafter: Drafter, seq: Sequence, fed: torch.Tensor, target: TargetOutput) -> None:
    """Hand a drafter that reads verify rows every row of the step's forward (others need nothing)."""
    if isinstance(drafter, ReadsVerifyRows):
        drafter.observe(seq, fed, target)


def parts(drafter: Drafter) -> list[Drafter]:
    """The drafters `drafter` is made of: a combination's members, or itself."""
    return drafter.parts() if isinstance(drafter, Composite) else [drafter]


def adapts_lengths(drafter: Drafter) -> bool:
    return isinstance(drafter, Composite) and drafter.adapts_lengths()


def auto_rank(cls: type[Drafter]) -> int | None:
    """Where `auto` tries the drafter among those found (lower first); None: never."""
    return cls.auto_rank if issubclass(cls, AutoMember) else None


def stands_for(cls: type[Drafter], resources: DrafterResources) -> list[str] | None:
    """The drafters a registered name that drafts nothing itself stands for; None for a drafter that drafts."""
    return cls.stands_for(resources) if issubclass(cls, StandsForOthers) else None


def finds_sources(cls: type[Drafter]) -> bool:
    return issubclass(cls, StandsForOthers) and cls.finds_sources
