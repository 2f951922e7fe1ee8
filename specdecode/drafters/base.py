"""The drafter protocol, its data types, and the registry that maps method names to drafters.

Invariant every drafter relies on: `seq.tokens` holds the prompt and every committed token; the last one has
not been through the target yet. A model-based drafter keeps its own cache as a prefix of `seq.tokens` and
catches up on whatever it has not seen at the start of each `propose`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from specdecode.config import SamplingParams, SpecConfig
from specdecode.errors import SpecDecodeError

if TYPE_CHECKING:
    from specdecode.models.loader import LoadedModel
    from specdecode.verify import VerifyResult


@dataclass
class SequenceState:
    tokens: list[int]  # prompt + committed output
    prompt_len: int
    sampling: SamplingParams
    generator: torch.Generator
    capacity: int  # the most tokens this sequence may ever hold (context limit)


@dataclass
class DraftProposal:
    tokens: list[int]  # [K] chain of drafted ids; empty = nothing to propose this step
    probs: torch.Tensor | None = None  # [K, V] draft distribution q; None = deterministic drafts
    source: str = ""  # which method produced it (a combination reports its winning member)

    @classmethod
    def empty(cls, source: str = "") -> DraftProposal:
        return cls([], None, source)


@dataclass
class DrafterContext:
    """What a drafter may need to build itself; each takes what it uses."""

    spec: SpecConfig
    target: LoadedModel
    draft: LoadedModel | None = None


class Drafter:
    name: ClassVar[str]
    needs_hidden_layers: ClassVar[tuple[int, ...]] = ()  # target hidden states (boundary ids) it reads
    needs_draft_model: ClassVar[bool] = False  # whether callers must load a draft model for it

    @classmethod
    def create(cls, context: DrafterContext) -> Drafter:
        return cls()

    def begin(self, seq: SequenceState) -> None:
        """Called once after the target's prefill."""

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        raise NotImplementedError

    def commit(self, seq: SequenceState, result: VerifyResult) -> None:
        """Called after `seq.tokens` gained the accepted tokens: advance or roll back own state."""


DRAFTERS: dict[str, type[Drafter]] = {}


def register(cls: type[Drafter]) -> type[Drafter]:
    DRAFTERS[cls.name] = cls
    return cls


class FallbackDrafter(Drafter):
    """A chain such as 'ngram,draft' (llama.cpp's rule): the first member with a draft wins the step."""

    name = "fallback"

    def __init__(self, members: list[Drafter]):
        self.members = members
        self.needs_hidden_layers = tuple(sorted({i for m in members for i in m.needs_hidden_layers}))

    def begin(self, seq: SequenceState) -> None:
        for member in self.members:
            member.begin(seq)

    def propose(self, seq: SequenceState, k: int) -> DraftProposal:
        for member in self.members:
            proposal = member.propose(seq, k)
            if proposal.tokens:
                return proposal
        return DraftProposal.empty(self.members[-1].name)

    def commit(self, seq: SequenceState, result: VerifyResult) -> None:
        for member in self.members:
            member.commit(seq, result)


def validate_method(spec: SpecConfig) -> tuple[str, ...]:
    methods = spec.methods
    unknown = [m for m in methods if m not in DRAFTERS]
    if not methods or unknown:
        raise SpecDecodeError(
            f"unknown speculative method {spec.method!r}; valid: {', '.join(sorted(DRAFTERS))} "
            "or a comma-separated chain such as 'ngram,draft'"
        )
    return methods


def needs_draft_model(spec: SpecConfig) -> bool:
    """Whether any method of `spec` drafts with a draft model, so callers load one only when it is used."""
    return any(DRAFTERS[m].needs_draft_model for m in validate_method(spec))


def build_drafter(context: DrafterContext) -> Drafter:
    members = [DRAFTERS[m].create(context) for m in validate_method(context.spec)]
    return members[0] if len(members) == 1 else FallbackDrafter(members)
