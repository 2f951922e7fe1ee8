"""The server reads an arriving prompt in chunks between batched steps (prefill.py, server/scheduler.py): the
answers stay what each request gives alone, the chunks interleave with the steps of requests already decoding,
and a request dropped while its prompt is read frees its place and its memory."""

from __future__ import annotations

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
from specdecode.server.scheduler import Job, Scheduler

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
    monkeypatch.setattr(w4a8_engine, "prefill", lambda request: events.append(("chunk", request)) or prefill(request))
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


class _CallNow:
    """Stands in for the event loop a Job answers through: hands every item over at once."""

    def call_soon_threadsafe(self, callback, item) -> None:
        callback(item)


def test_a_request_dropped_while_its_prompt_is_read_frees_its_place_and_memory(w4a8_engine):
    scheduler = Scheduler(w4a8_engine, max_active=4, prefill_chunk=2)
    jobs = [Job(w4a8_engine.encode(p, raw=True), SamplingParams(max_tokens=8), SpecConfig("ngram"),
                time.monotonic() + 60, _CallNow()) for p in PROMPTS[:2]]
    for job in jobs:
        scheduler.submit(job)
    scheduler._admit()
    assert scheduler.load == (2, 0) and len(scheduler.starting) == 2
    scheduler._read_prompt()  # nothing decodes yet: the first prompt is read whole
    assert len(scheduler.active) == 1 and jobs[0].events.qsize() == 1  # its first token went out
    scheduler._read_prompt()  # the second, one chunk, while the first decodes
    assert scheduler.starting[0][1].cache.lengths[0] == 2
    memory = scheduler.kv_bytes
    jobs[1].cancelled.set()
    scheduler._drop_ended()
    assert scheduler.load == (1, 0) and scheduler.admitted == 1
    assert scheduler.kv_bytes == scheduler.active[0][1].cache.nbytes < memory
    with pytest.raises(SpecDecodeError, match="prefill chunk"):
        Scheduler(w4a8_engine, prefill_chunk=-1)
