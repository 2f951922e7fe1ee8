"""One worker thread owns the models and steps every active request; the HTTP side talks to it through queues.

Batched (the default where the target is batch-invariant: w4a8, and bf16 or fp32 on a CPU with the
fixed-order float layers, see models/batch_invariance.py): each round is one `Engine.step_many` over all active
requests, their verify rows in one target forward, so many users share each pass over the weights and the
draft length shrinks as the batch grows (load_budget.py). Each request's output stays what it would be
alone, bit for bit. Interleaved (`batching="off"`, and the default for other targets, e.g. on a GPU, whose
matmuls round differently with more rows): one request's step at a time, as separate forwards.

Every request's KV cache is sized to it (prompt + max_tokens) and counted against one memory budget
(`kv_memory`): a request whose cache would not fit waits in the queue until enough ends, never fails for it.

The requests run in the engine's batch (engine/batch.py, the loop training's answers run too): prompts are read a
chunk at a time, one chunk per tick, between two rounds of the active requests' steps, the prompts being read
taking turns, so a long prompt slows the others but never stops them and a short prompt that arrives behind a
long one is read after one chunk of it. Between two ticks the worker admits new requests and drops those whose
client left or whose time ran out, and sees a shutdown. A chunk is sized to take about one round of steps
(engine/prefill_pace.py, which states the bound), or a fixed `prefill_chunk`.

The worker drives each request through the engine's one way in: begin, then the batch's ticks (prefill a chunk
per call, step_many, finish), and hands each event to its job. The HTTP side only checks requests
(Engine.check_spec builds nothing) and reads events.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from specdecode.config import SamplingParams, SpecConfig
from specdecode.engine.batch import RequestBatch
from specdecode.engine.engine import Engine
from specdecode.engine.prefill_pace import PrefillPace
from specdecode.engine.request import Request
from specdecode.errors import SpecDecodeError
from specdecode.models.batch_invariance import batch_invariant


class QueueFull(Exception):
    """No room for another request; the client should retry later."""


class RequestTimeout(SpecDecodeError):
    """The request ran past its time limit (waiting or generating)."""


class ShuttingDown(Exception):
    """The server is draining and takes no new requests."""


@dataclass(eq=False)  # identity equality: two requests with the same fields are still two requests
class Job:
    prompt_ids: list[int]  # checked by Engine.encode on the HTTP side
    sampling: SamplingParams
    spec: SpecConfig
    deadline: float  # time.monotonic() after which the job is ended with an error
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # GenerationEvent | SpecDecodeError | None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    reuse_prefix: bool = True  # the prompt's beginning may come from the engine's prefix cache
    provenance: bool = False  # events say where each token came from (engine/provenance.py)

    def send(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Scheduler:
    def __init__(self, engine: Engine, max_active: int = 8, max_queued: int = 64, batching: str = "auto",
                 kv_memory: int | None = None, prefill_chunk: int | None = None):
        """`batching`: on, off, or auto (on where the target is batch-invariant); `kv_memory`: bytes the active
        requests' target KV caches may hold together (None: no bound beyond max_active); `prefill_chunk`: prompt
        tokens each chunk reads (None: as many as take about one round of steps, engine/prefill_pace.py)."""
        if max_active < 1 or max_queued < 1:
            raise SpecDecodeError(f"need at least one active and one queued request, got max_active={max_active} "
                                  f"max_queued={max_queued}")
        if batching not in ("auto", "on", "off"):
            raise SpecDecodeError(f"batching is auto, on or off, not {batching!r}")
        if kv_memory is not None and kv_memory < 1:
            raise SpecDecodeError(f"the KV memory budget must be positive, got {kv_memory} bytes")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise SpecDecodeError(f"the prefill chunk must be at least 1 token (None: sized by measured times), "
                                  f"got {prefill_chunk}")
        self.engine = engine
        self.batching = batch_invariant(engine.target.model) if batching == "auto" else batching == "on"
        self.kv_memory = kv_memory
        self.batch = RequestBatch(engine, self.batching, PrefillPace(prefill_chunk))
        self.jobs: dict[Request, Job] = {}  # each request in the batch -> the job it serves
        self.lock = threading.Lock()
        self.max_active = max_active
        self.max_queued = max_queued
        # Requests submitted and not yet ended, queued or active, counted under the lock at submit: a burst
        # finds every free active slot too, not only the queue (the worker moves jobs to slots when it polls).
        self.admitted = 0
        self.pending: queue.Queue[Job] = queue.Queue()
        self.waiting: Job | None = None  # taken from the queue, waiting for KV memory to free up
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
        return len(self.batch), self.pending.qsize() + (self.waiting is not None)

    def check_fits(self, job: Job, exact: bool = True) -> int:
        """The bytes of the job's KV cache; a SpecDecodeError if they exceed the whole budget. The HTTP side asks
        with `exact=False` (a lower bound that builds no drafter: it answers 400 before queueing); the worker,
        which owns the models, asks for the exact size."""
        if exact:
            need = self.engine.request_cache_bytes(len(job.prompt_ids), job.sampling, job.spec)
        else:
            need = self.engine.least_cache_bytes(len(job.prompt_ids), job.sampling)
        if self.kv_memory is not None and need > self.kv_memory:
            raise SpecDecodeError(f"this request's KV cache needs {need / 2**20:.1f} MiB, more than the server's "
                                  f"whole budget of {self.kv_memory / 2**20:.1f} MiB (--kv-memory); ask for fewer "
                                  "max_tokens", "max_tokens")
        return need

    @property
    def kv_bytes(self) -> int:
        """Memory the active and starting requests' target KV caches hold."""
        return sum(request.cache.nbytes for request in self.batch.requests)

    def shutdown(self, grace_seconds: float) -> None:
        """Stop taking requests, let in-flight ones finish within the grace period, then end the rest cleanly."""
        with self.lock:
            self.draining = True
        deadline = time.monotonic() + grace_seconds
        while (len(self.batch) or self.waiting or not self.pending.empty()) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stopped.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stopped.is_set():
            self._tick()
        for request in list(self.batch.active):
            self._end(request, SpecDecodeError("the server shut down before this request finished"))
        queued = [self._leave(request) for request in list(self.batch.starting)]
        queued += [self.waiting] if self.waiting is not None else []
        while not self.pending.empty():
            queued.append(self.pending.get_nowait())
        for job in queued:  # still queued when the grace ran out: answer them too, or they hang
            job.send(SpecDecodeError("the server shut down before this request started"))
            self._release()

    def _tick(self) -> None:
        """New requests in, ended ones out, then the batch's tick (one chunk of a prompt, one round of steps): so a
        cancellation, a timeout, a new request or a shutdown waits for one chunk and one round at most."""
        self._admit()
        self._drop_ended()
        for item in self.batch.tick():
            job = self.jobs[item.request]
            job.send(item.event if item.error is None else item.error)
            if item.ended:
                del self.jobs[item.request]
                self._release()

    def _release(self) -> None:
        """A request ended (finished, failed, cancelled or timed out): its place is free."""
        with self.lock:
            self.admitted -= 1

    def _leave(self, request: Request) -> Job:
        """Take a request out of the batch before its end -> the job it served."""
        self.batch.drop(request)
        return self.jobs.pop(request)

    def _end(self, request: Request, item=None) -> None:
        """End a request before its last event, free its caches, and send `item` (an error) if any."""
        job = self._leave(request)
        if item is not None:
            job.send(item)
        self._release()

    def _next_job(self) -> Job | None:
        if self.waiting is not None:
            return self.waiting
        try:
            # Block briefly only when idle, so an active batch never waits on the queue.
            idle = not len(self.batch)
            return self.pending.get(timeout=0.05) if idle else self.pending.get_nowait()
        except queue.Empty:
            return None

    def _admit(self) -> None:
        while len(self.batch) < self.max_active:
            job = self._next_job()
            if job is None:
                return
            self.waiting = None
            if job.cancelled.is_set():
                self._release()
                continue
            if time.monotonic() > job.deadline:  # waited in the queue past its time limit
                job.send(RequestTimeout("request timed out"))
                self._release()
                continue
            try:
                need = self.check_fits(job)
                if self.kv_memory is not None and len(self.batch) and self.kv_bytes + need > self.kv_memory:
                    self.waiting = job  # first in line when enough memory frees up
                    return
                request = self.engine.begin(job.prompt_ids, job.sampling, job.spec, reuse_prefix=job.reuse_prefix,
                                            provenance=job.provenance)
            except Exception as error:  # noqa: BLE001 - a bug in one request's start must not stop the server
                job.send(error)
                self._release()
                continue
            self.jobs[request] = job
            self.batch.add(request)

    def _drop_ended(self) -> None:
        """Requests whose client went away or whose time ran out leave before the next tick (one that was still
        reading its prompt started no drafter: nothing more to finish than its caches)."""
        for request, job in list(self.jobs.items()):
            if job.cancelled.is_set():
                self._end(request)
            elif time.monotonic() > job.deadline:
                self._end(request, RequestTimeout("request timed out"))
