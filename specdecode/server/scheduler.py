"""One worker thread owns the models and interleaves every active request one speculative step at a time.

Requests never share state (each has its own caches, drafter and random generator), so interleaving only
changes latency, never output. The HTTP side talks to the worker through thread-safe queues.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from specdecode.config import SamplingParams, SpecConfig
from specdecode.engine import Engine, GenerationEvent
from specdecode.errors import SpecDecodeError


class QueueFull(Exception):
    """No room for another request; the client should retry later."""


class RequestTimeout(SpecDecodeError):
    """The request ran past its time limit (waiting or generating)."""


class ShuttingDown(Exception):
    """The server is draining and takes no new requests."""


@dataclass(eq=False)  # identity equality: two requests with the same fields are still two requests
class Job:
    prompt_ids: list[int]
    sampling: SamplingParams
    spec: SpecConfig
    deadline: float  # time.monotonic() after which the job is ended with an error
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # GenerationEvent | SpecDecodeError | None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)

    def send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Scheduler:
    def __init__(self, engine: Engine, max_active: int = 8, max_queued: int = 64):
        if max_active < 1 or max_queued < 1:
            raise SpecDecodeError(f"need at least one active and one queued request, got max_active={max_active} "
                                  f"max_queued={max_queued}")
        self.engine = engine
        self.lock = threading.Lock()
        self.max_active = max_active
        self.max_queued = max_queued
        # Requests submitted and not yet ended, queued or active, counted under the lock at submit: a burst
        # finds every free active slot too, not only the queue (the worker moves jobs to slots when it polls).
        self.admitted = 0
        self.pending: queue.Queue[Job] = queue.Queue()
        self.active: list[tuple[Job, Iterator[GenerationEvent]]] = []
        self.draining = False
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="specdecode-worker", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        # Under the lock, so a job is never queued after the worker's last look at the queue.
        with self.lock:
            if self.draining:
                raise ShuttingDown("the server is shutting down")
            if self.admitted >= self.max_active + self.max_queued:
                raise QueueFull(f"{self.max_active} requests are running and {self.max_queued} waiting")
            self.admitted += 1
            self.pending.put_nowait(job)

    @property
    def load(self) -> tuple[int, int]:
        return len(self.active), self.pending.qsize()

    def shutdown(self, grace_seconds: float) -> None:
        """Stop taking requests, let in-flight ones finish within the grace period, then end the rest cleanly."""
        with self.lock:
            self.draining = True
        deadline = time.monotonic() + grace_seconds
        while (self.active or not self.pending.empty()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stopped.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stopped.is_set():
            self._admit()
            if not self.active:
                continue
            for entry in list(self.active):
                self._advance(*entry)
        for job, generator in self.active:
            generator.close()
            job.send(SpecDecodeError("the server shut down before this request finished"))
            self._release()
        self.active.clear()
        while not self.pending.empty():  # still queued when the grace ran out: answer them too, or they hang
            self.pending.get_nowait().send(SpecDecodeError("the server shut down before this request started"))
            self._release()

    def _release(self) -> None:
        """A request ended (finished, failed, cancelled or timed out): its place is free."""
        with self.lock:
            self.admitted -= 1

    def _admit(self) -> None:
        while len(self.active) < self.max_active:
            try:
                # Block briefly only when idle, so an active batch never waits on the queue.
                job = self.pending.get(timeout=0.05) if not self.active else self.pending.get_nowait()
            except queue.Empty:
                return
            if job.cancelled.is_set():
                self._release()
                continue
            if time.monotonic() > job.deadline:  # waited in the queue past its time limit
                job.send(RequestTimeout("request timed out"))
                self._release()
                continue
            generator = self.engine.generate(job.prompt_ids, job.sampling, job.spec)
            self.active.append((job, generator))

    def _advance(self, job: Job, generator: Iterator[GenerationEvent]) -> None:
        """One step of one request: the unit of fairness between concurrent streams."""
        finished = True
        try:
            if job.cancelled.is_set():
                pass  # the client went away: drop its state without another step
            elif time.monotonic() > job.deadline:
                job.send(RequestTimeout("request timed out"))
            else:
                event = next(generator)
                job.send(event)
                finished = event.finish_reason is not None
        except SpecDecodeError as error:
            job.send(error)
        except StopIteration:
            job.send(None)
        except Exception as error:  # noqa: BLE001 - a bug in one request must not stop every other stream
            job.send(error)
        if finished:
            generator.close()  # frees the request's KV caches
            self.active.remove((job, generator))
            self._release()
