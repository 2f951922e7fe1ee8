"""The data one speculative step passes around: a request, a proposal, the target's output, the verdict.

Data only: no model calls and no acceptance math. Shapes: N proposed nodes (a chain or a tree), V vocabulary,
H hidden size, T rows of a target forward.

Invariant every drafter relies on: `Sequence.tokens` holds the prompt and every committed token; the last one
has not been through the target yet. A verify forward feeds that last token (the root, row 0) and the N
proposed nodes (rows 1..N) in one pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specdecode.config import SamplingParams, SpecConfig

if TYPE_CHECKING:
    from specdecode.acceptance.noise import PositionNoise
    from specdecode.drafters.base import Drafter
    from specdecode.models.decoder.kv_cache import KVCache


@dataclass(eq=False)  # identity equality: two requests with the same fields are still two requests
class Sequence:
    """One request's state as its drafter sees it between steps. The engine's own bookkeeping of the request (its
    speed guard, draft length, stats and stop decision) extends this in engine/request.py."""

    tokens: list[int]  # prompt + committed output
    prompt_len: int
    sampling: SamplingParams
    spec: SpecConfig
    generator: torch.Generator  # every random draw of this request, so a seed reproduces it
    capacity: int  # the most tokens this sequence may ever hold (context limit or prompt + max_tokens)
    cache: KVCache  # the target's KV cache, a prefix of `tokens` (all but the last)
    drafter: Drafter  # shared by every request of the Engine; its per-request state is in `drafter_state`
    draft_limit: int  # the most tokens one step may draft: a drafter keeps that much room in caches of its own
    drafter_state: dict[str, Any] = field(default_factory=dict)  # drafter name -> its state for this request
    # What a drafter says of how it drafted, counted (stats' drafter_notes): e.g. "dspark_confidence_cut".
    drafter_notes: dict[str, int] = field(default_factory=dict)
    # Per-step choice's record (combine="best"), member chosen (or "plain") -> what it promised and delivered.
    choices: dict[str, ChoiceRecord] = field(default_factory=dict)
    # Drafter name -> keys and values [L, Hkv, n, D] of the prompt's first n tokens from the prefix cache, for a
    # drafter that keeps its own cache of the tokens (Drafter.token_caches) to take as it starts.
    reused_drafter_rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # Under the coupled rule with sampling, the request's noise by position (acceptance/noise.py): the target and
    # every drafter that samples draw with it instead of `generator`. None otherwise.
    noise: PositionNoise | None = None
    # The target's prefill seconds per prompt token (the engine's estimate, from prompts longer than a catch-up;
    # None before one was read): per-step choice prices a deferred drafter's first catch-up by it until one has
    # been timed, a bound, since a drafter reads a token for less than its target does.
    target_prefill_seconds_per_token: float | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    def note(self, what: str, count: int = 1) -> None:
        self.drafter_notes[what] = self.drafter_notes.get(what, 0) + count


@dataclass
class ChoiceRecord:
    """The steps per-step choice gave one member (drafters/step_choice.py): what its estimates promised and what
    the steps delivered, as sums, so records of several requests add up."""

    steps: int = 0
    promised_tokens: float = 0.0  # expected committed tokens (accepted drafts + 1)
    promised_seconds: float = 0.0  # expected drafting + verify seconds
    tokens: int = 0  # committed tokens
    seconds: float = 0.0  # the steps' wall time from the first proposal to the commit
    drafted: int = 0  # draft depths verified (a mixture of experts' target prices each: step_choice.best_depth)

    def add(self, promised_tokens: float, promised_seconds: float, tokens: int, seconds: float,
            drafted: int = 0) -> None:
        self.steps += 1
        self.promised_tokens += promised_tokens
        self.promised_seconds += promised_seconds
        self.tokens += tokens
        self.seconds += seconds
        self.drafted += drafted

    def merge(self, other: ChoiceRecord) -> None:
        self.steps += other.steps
        self.promised_tokens += other.promised_tokens
        self.promised_seconds += other.promised_seconds
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.drafted += other.drafted

    def to_dict(self) -> dict:
        """Steps, and tokens per second promised against realised."""
        return {"steps": self.steps,
                "promised_tokens_per_second": round(self.promised_tokens / self.promised_seconds, 2)
                if self.promised_seconds else None,
                "realised_tokens_per_second": round(self.tokens / self.seconds, 2) if self.seconds else None,
                "promised_tokens_per_step": round(self.promised_tokens / self.steps, 3) if self.steps else None,
                "realised_tokens_per_step": round(self.tokens / self.steps, 3) if self.steps else None,
                "mean_draft_depth": round(self.drafted / self.steps, 3) if self.steps else None}


@dataclass
class DraftProposal:
    """What a drafter proposes for one step: a chain or a tree of tokens to verify in one target forward.

    Nodes are in topological order (a parent's index is below its children's), so the first n nodes of a
    proposal are a proposal too. Siblings are tried in index order during verification.
    """

    tokens: torch.Tensor  # [N] long, N = 0 for nothing to propose
    parents: torch.Tensor | None = None  # [N] long parent index, -1 = the last committed token; None = chain
    # [N, V] float: the distribution each node was drawn from (siblings drawn independently, each from its
    # row); None = deterministic drafts (argmax, top-k, lookups), verified against a one-hot q.
    probs: torch.Tensor | None = None
    source: str = ""  # the method that proposed it (a combination reports its winning member)
    withheld: str | None = None  # why it is empty when a drafter chose not to draft (stats' steps_without_draft)
    # Making it first read a context the drafter had deferred or fallen behind on (a draft model's catch-up,
    # combination.py): a one-off for the request's later steps, which the speed guard leaves out of its windows.
    caught_up: bool = False

    @classmethod
    def empty(cls, source: str = "", withheld: str | None = None) -> DraftProposal:
        return cls(torch.empty(0, dtype=torch.long), None, None, source, withheld)

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None, source: str = "") -> DraftProposal:
        return cls(torch.tensor(tokens, dtype=torch.long), None, probs, source)

    @property
    def size(self) -> int:
        return self.tokens.numel()

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    def parent_list(self) -> list[int]:
        """Parent of each node on the host (-1 = root); a chain's node i hangs off node i-1."""
        return list(range(-1, self.size - 1)) if self.parents is None else self.parents.tolist()


@dataclass
class TargetOutput:
    """What one target forward hands to verification and drafters, batch dimension removed.

    `hidden` and `final_hidden` cover every row fed; `logits` covers the last rows asked for (all rows of a
    verify forward, the last one of a prefill).
    """

    logits: torch.Tensor  # [T', V] float32
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # boundary id -> [T, H] (see DESIGN.md)
    final_hidden: torch.Tensor | None = None  # [T, H] after the final norm (MTP reads it); None = not asked

    @classmethod
    def joined(cls, parts: list[TargetOutput]) -> TargetOutput:
        """Outputs of consecutive rows (a prompt's chunks, a request's steps) as one: hidden states over every
        row, the last part's logits."""
        if len(parts) == 1:
            return parts[0]
        hidden = {layer: torch.cat([part.hidden[layer] for part in parts]) for layer in parts[0].hidden}  # [T, H]
        final = None if parts[0].final_hidden is None else torch.cat([part.final_hidden for part in parts])  # [T, H]
        return cls(parts[-1].logits, hidden, final)

    def rows(self, index: list[int]) -> TargetOutput:
        """The rows `index` (ascending) of every field (all fields must cover the same rows, as in a verify
        forward). A chain's accepted rows are a prefix: views, no copy."""
        at = slice(0, len(index)) if index[-1] == len(index) - 1 else torch.tensor(index, device=self.logits.device)
        return TargetOutput(self.logits[at], {k: v[at] for k, v in self.hidden.items()},
                            None if self.final_hidden is None else self.final_hidden[at])


@dataclass
class VerifyResult:
    """The verdict on one proposal.

    Terms (as in vLLM's rejection sampler): accepted tokens are the nodes on the path the target keeps;
    `next_token` is the recovered token (the target's replacement after a rejection) or the bonus token (one
    more from the target when the path ends at a node with no accepted child).
    """

    path: list[int]  # accepted node indices, root to leaf (a chain: 0, 1, ..., A-1)
    tokens: list[int]  # what the step commits: the accepted nodes' tokens, then next_token
    source: str = ""  # the proposal's source, so a chain's members know whose draft was verified

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @property
    def next_token(self) -> int:
        return self.tokens[-1]

    @property
    def kept_rows(self) -> list[int]:
        """Rows of the verify forward on the accepted path: the root, then each accepted node."""
        return [0, *(node + 1 for node in self.path)]
