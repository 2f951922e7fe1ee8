"""One request as the engine keeps it, and the events its front door is shown.

A `Request` is the drafter's view of a request (spec_types.Sequence) plus what the engine decides and measures
for it: its speed guard and draft length, its stats, the log-probabilities it asked for, the hidden states the
prefix cache keeps, and whether it has ended. The stop decision is made here, once, as each step's tokens are
committed (`Request.settle`): an end-of-turn token or a stop string cuts the committed tokens where plain
decoding would have stopped, and the token budget or the context ends the request. Every front door (Python API,
command line, server, bench) reads the same events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from time import perf_counter

import torch

from specdecode.acceptance.logprobs import TokenLogprob, token_logprobs
from specdecode.acceptance.relaxed import Relaxed
from specdecode.acceptance.verify import verify
from specdecode.drafters import capabilities
from specdecode.drafters.draft_length import DraftLength
from specdecode.engine.provenance import StepTrace, TokenOrigin
from specdecode.engine.speed_guard import SpeedGuard
from specdecode.engine.stats import GenerationStats
from specdecode.models.tokenizer import IncrementalDetokenizer
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult


@dataclass
class GenerationEvent:
    token_ids: list[int]  # ids committed since the previous event
    text: str  # text that became safe to show since the previous event
    finish_reason: str | None = None  # "stop" (end of turn or stop string) or "length" (max tokens / context)
    stats: GenerationStats | None = None  # on the last event only
    logprobs: list[TokenLogprob] | None = None  # one per id of token_ids, when sampling.logprobs asks
    # When the request asked for provenance (engine/provenance.py): one per id of token_ids, and the step that
    # committed them (None for the prefill's first token)
    origins: list[TokenOrigin] | None = None
    step: StepTrace | None = None


@dataclass(eq=False, kw_only=True)
class Request(Sequence):
    eos: frozenset[int]  # tokens that end the turn (empty with ignore_eos)
    guard: SpeedGuard  # shrinks or pauses drafting while it measures slower than plain decoding
    draft_length: DraftLength
    stats: GenerationStats
    detokenizer: IncrementalDetokenizer
    arrived: float  # perf_counter() when the request was begun: its total time counts from here
    chunk: int  # prompt tokens per prefill forward (the whole prompt unless a server reads it in chunks)
    relaxation: Relaxed | None  # the opt-in lossy acceptance rule (spec.relaxed, parsed); None = exact
    verification: str  # the rule its sampled drafts are verified by (SpecConfig.verification_for)
    # One per generated token when sampling.logprobs asks for them (acceptance/logprobs.py), else empty.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # The prompt's rows read so far (their hidden states; the last chunk's logits), joined once it is all read.
    prompt_parts: list[TargetOutput] = field(default_factory=list)
    # For the prefix cache: the hidden states the drafter read of every row in `cache`, in order (the prompt's,
    # then each step's kept rows); empty when the engine keeps no prefix cache or the drafter reads none.
    read_states: list[TargetOutput] = field(default_factory=list)
    finish_reason: str | None = None  # None while it runs; "stop" or "length" once it has ended
    provenance: bool = False  # events say where each token came from (engine/provenance.py)
    # With provenance: the origins of the tokens committed and not yet handed out, and the step that made them.
    pending_origins: list[TokenOrigin] = field(default_factory=list)
    last_step: StepTrace | None = None

    def verdict(self, proposal: DraftProposal, logits: torch.Tensor) -> VerifyResult:
        """The request's rule on `proposal` and the target's rows for it (logits [N+1, V]; the root's alone for
        the prefill's first token): coupled with its noise at the rows' positions, else by block or token-wise
        rejection sampling with its generator."""
        noise = None if self.noise is None else self.noise.for_proposal(proposal, len(self.tokens))  # [N+1, V]
        return verify(proposal, logits, self.sampling, self.generator, self.relaxation,
                      block=self.verification == "block", noise=noise)

    @property
    def started(self) -> bool:
        """Whether the prompt is read and the first token sampled (the request can step)."""
        return len(self.tokens) > self.prompt_len

    def settle(self, new_ids: list[int]) -> GenerationEvent:
        """The event for the ids just committed (the last `len(new_ids)` of `tokens`), after the stop decision:
        ids after an end-of-turn token or past a stop string are taken back, and the request ends at an end of
        turn, a stop string, its token budget or the context."""
        new_ids, finish = self._cut_at_end_of_turn(new_ids)
        text = self.detokenizer.add(new_ids)
        if self.detokenizer.stopped:  # end at the token that completed the stop string, as plain decoding would
            del self.tokens[len(self.tokens) - len(new_ids) + self.detokenizer.consumed :]
            new_ids, finish = new_ids[: self.detokenizer.consumed], "stop"
        logprobs = self.logprobs[self.generated - len(new_ids) : self.generated] if self.sampling.logprobs is not None \
            else None
        origins, step = None, None
        if self.provenance:
            origins, step = self.pending_origins[: len(new_ids)], self.last_step
            self.pending_origins, self.last_step = [], None
        if finish is None:
            return GenerationEvent(new_ids, text, logprobs=logprobs, origins=origins, step=step)
        self.finish_reason = finish
        self.stats.new_tokens = self.generated
        self.stats.total_seconds = perf_counter() - self.arrived
        self.close_stats()
        return GenerationEvent(new_ids, text + self.detokenizer.flush(), finish, self.stats, logprobs, origins, step)

    def _cut_at_end_of_turn(self, new_ids: list[int]) -> tuple[list[int], str | None]:
        """Take back the ids after an end-of-turn token; say why the request ends, if it does. (A step's draft
        budget keeps it within the token budget and the context: Engine._wanted.)"""
        for i, token in enumerate(new_ids):
            if token in self.eos:
                del self.tokens[len(self.tokens) - len(new_ids) + i + 1 :]
                return new_ids[: i + 1], "stop"
        if self.generated >= self.sampling.max_tokens or len(self.tokens) >= self.capacity:
            return new_ids, "length"
        return new_ids, None

    def record_logprobs(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """Only when the request asks: row i of logits [len(tokens), V] is the distribution tokens[i] came from."""
        if self.sampling.logprobs is not None:
            self.logprobs.extend(token_logprobs(logits, tokens, self.sampling.logprobs))

    def close_stats(self) -> None:
        """Stats known once the request stops stepping: its memory and what the speed guard did."""
        self.stats.kv_cache_bytes = self.cache.nbytes
        self.stats.drafter_request_bytes = capabilities.request_bytes(self.drafter, self)
        self.stats.guard_shrinks, self.stats.guard_pauses = self.guard.shrinks, self.guard.pauses
