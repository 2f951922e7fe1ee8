"""Many requests through one Engine at once: the loop the server's worker and training's answers both run.

A request joins begun (Engine.begin), its prompt not read. Each `tick` reads one chunk of the prompt whose turn it
is (the prompts being read take turns, a chunk sized by prefill_pace.py) and then runs one round of steps of the
requests whose prompts are read: all in one `Engine.step_many` when `batched` (their verify rows in one target
forward), else one request's step at a time. So a long prompt slows the others but never stops them, and whoever
drives the batch (admitting, cancelling, timing out requests) gets its turn between two ticks. A request that ends
(its last event, an error in its prefill or step, or `drop`) is finished and leaves the batch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from specdecode.engine.engine import Engine
from specdecode.engine.prefill_pace import PrefillPace
from specdecode.engine.request import GenerationEvent, Request


@dataclass
class BatchEvent:
    """What one request brought out of a tick: its event, or the error that ended it (then `event` is None)."""

    request: Request
    event: GenerationEvent | None
    error: Exception | None = None

    @property
    def ended(self) -> bool:
        return self.error is not None or self.event.finish_reason is not None


class RequestBatch:
    def __init__(self, engine: Engine, batched: bool, pace: PrefillPace | None = None):
        """`batched`: every ready request's step in one forward (a batch-invariant target keeps each one's output
        what it is alone), else one step at a time; `pace`: the prefill chunks' sizes (default: by measured times)."""
        self.engine = engine
        self.batched = batched
        self.pace = pace or PrefillPace()
        self.starting: deque[Request] = deque()  # prompts being read, the next to read a chunk first
        self.active: list[Request] = []  # prompts read, stepping

    def __len__(self) -> int:
        return len(self.starting) + len(self.active)

    @property
    def requests(self) -> list[Request]:
        """Every request in the batch (a copy: the batch's lists change as it runs)."""
        return list(self.starting) + list(self.active)

    def add(self, request: Request) -> None:
        """A begun request, whose prompt the next ticks read."""
        self.starting.append(request)

    def drop(self, request: Request) -> None:
        """Take a request out before its end (its client left, its time ran out); a request whose prompt was being
        read started no drafter, so there is nothing more to finish than its caches."""
        if request in self.starting:
            self.starting.remove(request)
            return
        self.active.remove(request)
        self.engine.finish(request)

    def tick(self) -> list[BatchEvent]:
        """One chunk of a prompt, then one round of steps; -> the events, each request's in order."""
        events = self._read_prompt()
        if self.active:
            began = time.perf_counter()
            groups = [list(self.active)] if self.batched else [[request] for request in self.active]
            for group in groups:
                events.extend(self._step(group))
            self.pace.observe_round(time.perf_counter() - began)
        return events

    def _read_prompt(self) -> list[BatchEvent]:
        """One chunk of the prompt whose turn it is; then the next prompt's turn (a request whose prompt is all
        read joins the active ones, with its first event)."""
        if not self.starting:
            return []
        request = self.starting[0]
        tokens = self.pace.chunk_tokens(request)
        began = time.perf_counter()
        try:
            first = self.engine.prefill(request, tokens)
        except Exception as error:  # noqa: BLE001 - one request's failure is its own: the others go on
            self.starting.popleft()
            return [BatchEvent(request, None, error)]
        if first is None:
            self.pace.observe_chunk(request, tokens, time.perf_counter() - began)
            self.starting.rotate(-1)  # to the back of the line, in one step: other threads count `starting`
            return []
        self.starting.popleft()
        self.active.append(request)
        return [self._settled(request, first)]

    def _step(self, group: list[Request]) -> list[BatchEvent]:
        """One step of every request in `group`, in one forward: the unit of fairness between streams."""
        try:
            events = self.engine.step_many(group)
        except Exception as error:  # noqa: BLE001 - end this group's requests with the error; the batch goes on
            for request in group:
                self.active.remove(request)
                self.engine.finish(request)
            return [BatchEvent(request, None, error) for request in group]
        return [self._settled(request, event) for request, event in zip(group, events)]

    def _settled(self, request: Request, event: GenerationEvent) -> BatchEvent:
        if event.finish_reason is not None:
            self.active.remove(request)
            self.engine.finish(request)
        return BatchEvent(request, event)
