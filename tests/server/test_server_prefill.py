"""The server reads every prompt in chunks, one per tick between rounds of steps (prefill.py, server/scheduler.py,
engine/prefill_pace.py): the answers stay what each request gives alone, a short request is answered while a long
prompt is still read, and a request cancelled, timed out or shut down while its prompt is read stops within one
chunk and frees its place and its memory. No test here reads a clock: the order of events is what is checked."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from conftest import save_tiny_model
from test_server import MODEL, SETTINGS, running

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.errors import SpecDecodeError
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model
from specdecode.server.app import create_app
from specdecode.engine.prefill_pace import (
    FIRST_CHUNK_TOKENS,
    MAX_CHUNK_TOKENS,
    MIN_CHUNK_SECONDS,
    MIN_CHUNK_TOKENS,
    PrefillPace,
)
from specdecode.server.scheduler import Job, RequestTimeout, Scheduler

PROMPTS = ["hello hello hello", "abcabcabc abcabc", "The quick brown fox", "1 2 3 1 2 3 1 2"]


@pytest.fixture(scope="module")
def w4a8_engine(tmp_path_factory):
    reason = w4a8_unavailable()
    if reason is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {reason}")
    root = tmp_path_factory.mktemp("server-prefill")
    return Engine(load_model(save_tiny_model(root / "target", "qwen2", scale=0.15), dtype="bfloat16", quant="w4a8"),
                  load_model(save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01), dtype="bfloat16",
                             quant="w4a8"))


def test_prompts_read_in_chunks_between_batched_steps_answer_as_alone(w4a8_engine, monkeypatch):
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = {p: w4a8_engine.complete(p, sampling, SpecConfig("draft"), raw=True).text for p in PROMPTS}
    events = []  # ("chunk", the request) and ("step", batch size), in the worker's order
    prefill, step_many = w4a8_engine.prefill, w4a8_engine.step_many
    monkeypatch.setattr(w4a8_engine, "prefill",
                        lambda request, tokens: events.append(("chunk", request)) or prefill(request, tokens))
    monkeypatch.setattr(w4a8_engine, "step_many", lambda seqs: events.append(("step", len(seqs))) or step_many(seqs))
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "speculative": {"method": "draft"}}
    with running(create_app(w4a8_engine, replace(SETTINGS, prefill_chunk=2))) as server:
        with ThreadPoolExecutor(max_workers=4) as pool:
            answers = list(pool.map(lambda p: server.post("/v1/completions", {**body, "prompt": p}), PROMPTS * 2))
    for prompt, (status, answer) in zip(PROMPTS * 2, answers):
        assert status == 200 and answer["choices"][0]["text"] == expected[prompt]
    chunks = [i for i, (kind, _) in enumerate(events) if kind == "chunk"]
    assert chunks, "no prompt was read in chunks (all arrived while the server was idle?)"
    # Some prompt was read in several chunks with batched steps of others in between.
    by_prefill = {}
    for i in chunks:
        by_prefill.setdefault(id(events[i][1]), []).append(i)
    assert any(len(at) > 1 and any(events[j][0] == "step" for j in range(at[0], at[-1])) for at in by_prefill.values())


LONG = 64  # tokens of the long prompt: 16 chunks of CHUNK
CHUNK = 4


class _Logged:
    """Stands in for the event loop a Job answers through: hands every item over at once and logs it, tagged with
    the job, in the worker's order."""

    def __init__(self, log: list, tag: str):
        self.log, self.tag = log, tag

    def call_soon_threadsafe(self, callback, item) -> None:
        self.log.append(("sent", self.tag, item))
        callback(item)


@pytest.fixture(scope="module")
def float_engine(noisy_pair):
    return Engine(*noisy_pair, SpecConfig("ngram"))


def logged_job(engine: Engine, log: list, tag: str, prompt_ids: list[int], max_tokens: int) -> Job:
    return Job(prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), SpecConfig("ngram"),
               time.monotonic() + 600, _Logged(log, tag))


def logged_chunks(engine: Engine, monkeypatch, log: list) -> None:
    """Every prefill call logs ("chunk", the prompt's length, tokens asked for) before it reads."""
    prefill = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda request, tokens: log.append(("chunk", request.prompt_len, tokens))
                        or prefill(request, tokens))


def long_prompt() -> list[int]:
    return [(7 * i) % 200 + 10 for i in range(LONG)]


@pytest.mark.parametrize("batching", ["on", "off"])
def test_a_short_request_decodes_while_a_long_prompt_is_read(float_engine, monkeypatch, batching):
    """The long prompt arrives first and alone; the short one arrives after its first chunk, yet is answered in full
    before the long prompt is all read: ordering, not seconds. The worker's own loop body runs each tick."""
    log = []
    logged_chunks(float_engine, monkeypatch, log)
    scheduler = Scheduler(float_engine, max_active=4, batching=batching, prefill_chunk=CHUNK)
    scheduler.submit(logged_job(float_engine, log, "long", long_prompt(), 2))
    scheduler._tick()  # the long prompt's first chunk, with no one decoding: a chunk, not the whole prompt
    assert [entry[0] for entry in log] == ["chunk"] and len(scheduler.batch.starting) == 1
    scheduler.submit(logged_job(float_engine, log, "short", [65, 66, 67], 6))
    for _ in range(10 * LONG):
        if scheduler.load == (0, 0):
            break
        scheduler._tick()
    else:
        pytest.fail("the requests did not end")
    sent = [(i, tag, item) for i, (kind, tag, item) in enumerate(log) if kind == "sent"]
    short_done = next(i for i, tag, item in sent if tag == "short" and item.finish_reason is not None)
    long_first = next(i for i, tag, _ in sent if tag == "long")  # its first token: after its whole prompt
    long_chunks = [i for i, entry in enumerate(log) if entry[0] == "chunk" and entry[1] == LONG]
    assert len(long_chunks) == LONG // CHUNK
    assert short_done < long_first and long_chunks[0] < short_done < long_chunks[-1]
    assert [item.finish_reason for _, tag, item in sent if tag == "short"][-1] == "length"


@pytest.mark.parametrize("ending", ["cancelled", "timed out"])
def test_a_request_that_ends_while_its_prompt_is_read_stops_within_one_chunk(float_engine, monkeypatch, ending):
    log = []
    logged_chunks(float_engine, monkeypatch, log)
    scheduler = Scheduler(float_engine, max_active=4, prefill_chunk=CHUNK)
    job = logged_job(float_engine, log, "long", long_prompt(), 8)
    scheduler.submit(job)
    scheduler._tick()
    memory = scheduler.kv_bytes
    assert len(log) == 1 and memory > 0
    if ending == "cancelled":
        job.cancelled.set()
    else:
        job.deadline = time.monotonic() - 1  # its time ran out while the chunk was read
    scheduler._tick()
    assert [entry[0] for entry in log].count("chunk") == 1  # no chunk read after it ended
    assert scheduler.load == (0, 0) and scheduler.admitted == 0 and scheduler.kv_bytes == 0
    answers = [item for kind, _, item in log if kind == "sent"]
    if ending == "cancelled":
        assert answers == []  # no one is listening
    else:
        assert len(answers) == 1 and isinstance(answers[0], RequestTimeout)


def test_shutdown_while_a_prompt_is_read_stops_after_the_chunk_in_progress(float_engine, monkeypatch):
    """The worker thread is held inside the long prompt's first chunk while shutdown begins (grace 0): it reads no
    further chunk and answers the request."""
    log, inside, release = [], threading.Event(), threading.Event()
    prefill = float_engine.prefill

    def held_prefill(request, tokens):
        log.append(("chunk", request.prompt_len, tokens))
        inside.set()
        release.wait()
        return prefill(request, tokens)

    monkeypatch.setattr(float_engine, "prefill", held_prefill)
    scheduler = Scheduler(float_engine, max_active=4, prefill_chunk=CHUNK)
    scheduler.start()
    job = logged_job(float_engine, log, "long", long_prompt(), 8)
    scheduler.submit(job)
    inside.wait()
    stopping = threading.Thread(target=scheduler.shutdown, args=(0.0,))
    stopping.start()
    scheduler.stopped.wait()
    release.set()
    stopping.join()
    scheduler.thread.join()
    assert [entry[0] for entry in log].count("chunk") == 1
    answers = [item for kind, _, item in log if kind == "sent"]
    assert len(answers) == 1 and "shut down before this request started" in str(answers[0])


def test_the_pace_sizes_a_chunk_to_a_round_of_steps_at_its_own_requests_rate():
    """Scripted times (no clock): a chunk gets the time of a round, at least MIN_CHUNK_SECONDS, at the rate its
    request's previous chunk was read; a request's first chunk takes the newest rate of any."""
    pace, one, other = PrefillPace(), _Request(), _Request()
    assert pace.chunk_tokens(one) == FIRST_CHUNK_TOKENS  # nothing timed yet
    pace.observe_chunk(one, 64, 0.5)  # 1/128 s a token, no round timed: the least budget
    assert pace.chunk_tokens(one) == MIN_CHUNK_SECONDS * 128
    pace.observe_round(1.0)  # rounds of a second: a chunk gets a second
    assert pace.chunk_tokens(one) == 128 and pace.chunk_tokens(other) == 128  # the other's first: the newest rate
    pace.observe_chunk(other, 128, 2.0)  # 1/64 s a token (further into a long prompt)
    assert pace.chunk_tokens(other) == 64 and pace.chunk_tokens(one) == 128
    pace.observe_chunk(one, 128, 100.0)  # a very slow chunk: still some headway
    assert pace.chunk_tokens(one) == MIN_CHUNK_TOKENS
    pace.observe_chunk(one, 128, 1e-9)  # a very quick one: no more than one forward should hold
    assert pace.chunk_tokens(one) == MAX_CHUNK_TOKENS
    assert PrefillPace(fixed_tokens=7).chunk_tokens(one) == 7


def test_a_fixed_chunk_is_at_least_one_token(float_engine):
    with pytest.raises(SpecDecodeError, match="prefill chunk must be at least 1 token"):
        Scheduler(float_engine, prefill_chunk=0)


class _Request:
    """A stand-in request: the pace keys its estimates by the request's identity alone."""
