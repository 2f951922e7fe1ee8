"""How many prompt tokens a batch's next prefill chunk reads: as many as take about one round of decoding.

A batch (batch.py: the server's worker, training's answers) reads prompts one chunk per tick, between two rounds
of the active requests' steps, so while a prompt is read each decoding request waits one chunk between two of its
tokens. A chunk given as much time
as a round at most halves their token rate; a chunk far shorter than a forward's fixed cost (streaming the
weights: about 45 ms for the default target on a CPU) would read the prompt mostly in overhead. So a chunk's time
budget is the last rounds' measured time, but at least MIN_CHUNK_SECONDS, and it reads as many tokens as that
buys at the rate its request's previous chunk was read: a later chunk attends to more keys, so its own request's
last chunk is the best guess; a request's first chunk takes the newest rate of any. The rate is a whole chunk's
seconds per token, fixed cost included, so the size settles where a chunk's time meets its budget.

The bound this gives: while prompts are read, a decoding request's next token waits for at most one round of
steps and one chunk, the chunk sized to take max(a round, 0.25 s): about twice its step, or its step plus 0.25 s
where steps are quicker. A chunk reads at least MIN_CHUNK_TOKENS (so a slow machine still makes headway) and at
most MAX_CHUNK_TOKENS (what one forward's activations may hold). The same chunk bounds how long a cancelled or
timed-out request, a new arrival's admission and a shutdown wait: the server's worker looks at them between ticks.
`serve --prefill-chunk N` fixes the size instead.
"""

from __future__ import annotations

import weakref

from specdecode.spec_types import Sequence

MIN_CHUNK_SECONDS = 0.25  # a chunk's least time budget: above a forward's fixed cost, so the prompt read pays
MIN_CHUNK_TOKENS = 16
MAX_CHUNK_TOKENS = 2048  # vLLM's default token budget of a chunked-prefill step
FIRST_CHUNK_TOKENS = 64  # before any chunk was timed
SMOOTHING = 0.3  # weight of the newest round in the running estimate of a round's time


class PrefillPace:
    """`chunk_tokens` before a chunk, `observe_chunk` after it, `observe_round` after each round of steps."""

    def __init__(self, fixed_tokens: int | None = None):
        """`fixed_tokens`: every chunk this many tokens (the user's choice); None: sized by measured times."""
        self.fixed_tokens = fixed_tokens
        self.round_seconds: float | None = None  # running estimate of one round of the active requests' steps
        self.newest_rate: float | None = None  # seconds per token of the newest chunk timed, any request's
        self._rates: weakref.WeakKeyDictionary[Sequence, float] = weakref.WeakKeyDictionary()  # each request's last

    @property
    def budget_seconds(self) -> float:
        """The time a chunk is sized to take."""
        return max(MIN_CHUNK_SECONDS, self.round_seconds or 0.0)

    def chunk_tokens(self, request: Sequence) -> int:
        """Prompt tokens `request`'s next chunk reads."""
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        rate = self._rates.get(request, self.newest_rate)
        if rate is None:
            return FIRST_CHUNK_TOKENS
        affordable = self.budget_seconds / rate if rate > 0 else MAX_CHUNK_TOKENS
        return max(MIN_CHUNK_TOKENS, min(MAX_CHUNK_TOKENS, int(affordable)))

    def observe_chunk(self, request: Sequence, tokens: int, seconds: float) -> None:
        """A chunk of `tokens` prompt tokens that took `seconds` (a prompt's last chunk is not one to time: it also
        samples the first token and starts the drafter)."""
        self._rates[request] = self.newest_rate = seconds / tokens

    def observe_round(self, seconds: float) -> None:
        """One round of the active requests' steps (one batched step, or each request's when interleaved)."""
        known = self.round_seconds
        self.round_seconds = seconds if known is None else known + SMOOTHING * (seconds - known)
