"""One request as its front door sees it: committed token ids in, events out.

The engine's steps commit tokens; a stream turns them into what a client is shown: the ids up to an end of
turn or a stop string, the text that is safe to show so far, their log-probabilities when asked, and the
request's stats on the last event. `Engine.generate` steps one stream at a time; the server's scheduler steps
many in one batch (Engine.step_many) and hands each its own tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter

from specdecode.logprobs import TokenLogprob
from specdecode.spec_types import Sequence
from specdecode.stats import GenerationStats
from specdecode.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class GenerationEvent:
    token_ids: list[int]  # ids committed since the previous event
    text: str  # text that became safe to show since the previous event
    finish_reason: str | None = None  # "stop" (end of turn or stop string) or "length" (max tokens / context)
    stats: GenerationStats | None = None  # on the last event only
    logprobs: list[TokenLogprob] | None = None  # one per id of token_ids, when sampling.logprobs asks


class RequestStream:
    def __init__(self, seq: Sequence, tokenizer: Tokenizer, started: float, on_end: Callable[[Sequence], None]):
        """`started`: perf_counter() when the request arrived; `on_end(seq)` records what is known once it stops
        stepping (before the last event, so that a server reads complete stats from it)."""
        self.seq = seq
        self.detokenizer = IncrementalDetokenizer(tokenizer, seq.sampling.stop)
        self.started = started
        self.on_end = on_end

    def first_event(self) -> GenerationEvent:
        """The event for the token the prefill sampled."""
        return self.event(self.seq.tokens[-1:])

    def event(self, new_ids: list[int]) -> GenerationEvent:
        """The event for the ids a step just committed; the last one has a finish reason and the stats."""
        seq = self.seq
        new_ids, finish = self._finish_reason(new_ids)
        text = self.detokenizer.add(new_ids)
        if self.detokenizer.stopped:
            # End at the token that completed the stop string, as plain decoding would.
            del seq.tokens[len(seq.tokens) - len(new_ids) + self.detokenizer.consumed :]
            new_ids, finish = new_ids[: self.detokenizer.consumed], "stop"
        if finish is None:
            return GenerationEvent(new_ids, text, logprobs=self._newest_logprobs(new_ids))
        seq.stats.new_tokens = seq.generated
        seq.stats.total_seconds = perf_counter() - self.started
        self.on_end(seq)
        return GenerationEvent(new_ids, text + self.detokenizer.flush(), finish, seq.stats,
                               self._newest_logprobs(new_ids))

    def _finish_reason(self, new_ids: list[int]) -> tuple[list[int], str | None]:
        """Cut the newest ids after an end-of-turn token; say why generation ends, if it does.

        A step's draft budget keeps it within the token budget and the context (Engine._wanted).
        """
        seq = self.seq
        for i, token in enumerate(new_ids):
            if token in seq.eos:
                del seq.tokens[len(seq.tokens) - len(new_ids) + i + 1 :]
                return new_ids[: i + 1], "stop"
        if seq.generated >= seq.sampling.max_tokens or len(seq.tokens) >= seq.capacity:
            return new_ids, "length"
        return new_ids, None

    def _newest_logprobs(self, new_ids: list[int]) -> list[TokenLogprob] | None:
        """The log-probabilities of `new_ids`, the newest generated tokens (after any end-of-turn or stop cut)."""
        seq = self.seq
        if seq.sampling.logprobs is None:
            return None
        return seq.logprobs[seq.generated - len(new_ids) : seq.generated]
