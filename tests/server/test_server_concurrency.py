"""The server under concurrent load and at its edges: fairness, a full queue, disconnects, timeouts, shutdown."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from conftest import save_tiny_model
from test_server import MODEL, PROMPTS, SETTINGS, RunningServer, assert_openai_error, running, stream_text

from specdecode import Engine, SamplingParams
from specdecode.models.loader import load_model
from specdecode.server.app import DrainingServer, create_app

METHODS = ["none", "ngram", "draft", "ngram,draft"]
LONG = {"model": MODEL, "prompt": "hi", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
        "speculative": {"method": "none"}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny pair with a long context, so that a request can run for seconds (see the disconnect test)."""
    root, long_context = tmp_path_factory.mktemp("server-load"), {"max_position_embeddings": 8192}
    target = load_model(save_tiny_model(root / "target", "qwen2", scale=0.15, **long_context), dtype="float32")
    draft = load_model(save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01, **long_context),
                       dtype="float32")
    return Engine(target, draft, SETTINGS.spec)


@pytest.fixture(scope="module", params=["on", "off"])
def served(engine, request):
    """Served batched (the default for this float32 target: its layers are batch-invariant) and interleaved."""
    with running(create_app(engine, replace(SETTINGS, batching=request.param))) as server:
        yield server


def wait_until_idle(server: RunningServer, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while server.health()["active"] or server.health()["queued"]:
        assert time.monotonic() < deadline, f"still busy: {server.health()}"
        time.sleep(0.02)


def test_200_streams_from_32_clients_match_single_requests_and_move_metrics_exactly(served, engine, monkeypatch):
    # Batched, the load budget withholds drafts when its measured timings say they do not pay (load_budget.py,
    # tested on a scripted clock in test_load_budget.py): held open here, every request drafts whatever the load.
    monkeypatch.setattr(engine.load_budget, "draft_cap", lambda seqs, wanted: max(wanted))
    sampling = SamplingParams(max_tokens=16)
    expected = {(chat, p): engine.complete([{"role": "user", "content": p}] if chat else p, sampling, raw=not chat)
                for chat in (False, True) for p in PROMPTS}
    requests = [(i % 2 == 1, PROMPTS[i // 2 % len(PROMPTS)], METHODS[i // 8 % len(METHODS)]) for i in range(200)]
    counters = ("specdecode_generation_tokens_total", "specdecode_spec_drafted_tokens_total",
                "specdecode_spec_accepted_tokens_total")
    before = {name: served.metric(name) for name in counters}
    before_ok = {path: served.metric("specdecode_requests_total", endpoint=path, status="200")
                 for path in ("/v1/completions", "/v1/chat/completions")}

    def send(request):
        chat, prompt, method = request
        body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "speculative": {"method": method},
                "stream_options": {"include_usage": True}}
        body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        return stream_text(served.stream("/v1/chat/completions" if chat else "/v1/completions", body))

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(send, requests))

    tokens = drafted = accepted = 0
    for (chat, prompt, method), (text, finish, usage_chunk) in zip(requests, results, strict=True):
        reference = expected[chat, prompt]
        assert (text, finish) == (reference.text, reference.finish_reason), (chat, prompt, method)
        assert usage_chunk["usage"]["completion_tokens"] == len(reference.token_ids)
        spec = usage_chunk["speculative"]
        assert spec["method"] == method and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
        assert (spec["drafted_tokens"] == 0) == (method == "none")
        tokens += usage_chunk["usage"]["completion_tokens"]
        drafted, accepted = drafted + spec["drafted_tokens"], accepted + spec["accepted_tokens"]
    assert drafted > 0
    after = {name: served.metric(name) for name in counters}
    assert [after[name] - before[name] for name in counters] == [tokens, drafted, accepted]
    for path, chat in (("/v1/completions", False), ("/v1/chat/completions", True)):
        sent = sum(1 for request in requests if request[0] == chat)
        assert served.metric("specdecode_requests_total", endpoint=path, status="200") - before_ok[path] == sent
    assert served.health() == {"status": "ok", "active": 0, "queued": 0}


def test_two_long_streams_interleave_step_by_step(served):
    arrivals: dict[int, list[float]] = {0: [], 1: []}

    def consume(index: int) -> None:
        served.stream("/v1/completions", LONG, on_chunk=lambda _: arrivals[index].append(time.monotonic()))

    threads = [threading.Thread(target=consume, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    first, second = (sorted(arrivals[i]) for i in (0, 1))
    assert len(first) > 100 and len(second) > 100
    # Each stream's first chunk lands while the other is still well short of its end.
    assert sum(t > second[0] for t in first) > len(first) // 2
    assert sum(t > first[0] for t in second) > len(second) // 2


@pytest.mark.parametrize("max_active, max_queued", [(1, 1), (2, 1), (1, 3)])
def test_a_burst_fills_active_and_queued_places_exactly_then_429_with_retry_after(engine, max_active, max_queued):
    # The worker takes queued jobs into active slots only when it next polls: admission must count both.
    with running(create_app(engine, replace(SETTINGS, max_active=max_active, max_queued=max_queued))) as server:
        burst = max_active + max_queued + 3
        gate = threading.Barrier(burst)

        def send(_):
            gate.wait()
            return server.request("POST", "/v1/completions", LONG)

        with ThreadPoolExecutor(max_workers=burst) as pool:
            answers = list(pool.map(send, range(burst)))
        statuses = [status for status, _, _ in answers]
        assert statuses.count(200) == max_active + max_queued and statuses.count(429) == 3
        for status, headers, raw in answers:
            if status == 429:
                assert headers["retry-after"] == "1"
                assert assert_openai_error(status, json.loads(raw), 429)["type"] == "rate_limit_error"
            else:
                body = json.loads(raw)
                assert body["usage"]["completion_tokens"] == 400 and body["choices"][0]["finish_reason"] == "length"
        wait_until_idle(server)


def test_client_disconnect_ends_the_generation_and_frees_the_slot(served):
    body = json.dumps({**LONG, "max_tokens": 8000, "stream": True}).encode()  # seconds of work if left running
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while b"data: " not in received:
            received += conn.recv(4096)
        assert received.startswith(b"HTTP/1.1 200") and served.health()["active"] == 1
        left = served.metric("specdecode_requests_total", endpoint="/v1/completions", status="499")
    wait_until_idle(served, seconds=1.5)
    deadline = time.monotonic() + 5  # the stream's generator is closed a moment after the connection
    while served.metric("specdecode_requests_total", endpoint="/v1/completions", status="499") != left + 1:
        assert time.monotonic() < deadline, "an abandoned stream was not counted"
        time.sleep(0.02)
    status, body = served.post("/v1/completions", {"prompt": "hi", "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_request_over_its_time_limit_ends_with_an_error_and_server_keeps_serving(engine):
    with running(create_app(engine, replace(SETTINGS, request_timeout=0.05))) as server:
        error = assert_openai_error(*server.post("/v1/completions", LONG), 408)
        assert "timed out" in error["message"]
        payloads = server.stream("/v1/chat/completions", {**LONG, "messages": [{"role": "user", "content": "hi"}]})
        assert payloads[-1] == "[DONE]"
        errors = [json.loads(p)["error"] for p in payloads[:-1] if "error" in json.loads(p)]
        assert len(errors) == 1 and "timed out" in errors[0]["message"]
        wait_until_idle(server)
        assert server.metric("specdecode_requests_total", status="408") == 2
        assert server.request("GET", "/v1/models")[0] == 200


def test_shutdown_with_a_stream_in_flight_ends_it_cleanly(engine):
    server = RunningServer(create_app(engine, SETTINGS))
    first_chunk, outcome = threading.Event(), {}

    def consume() -> None:
        outcome["payloads"] = server.stream("/v1/completions", LONG, on_chunk=lambda _: first_chunk.set())

    reader = threading.Thread(target=consume)
    reader.start()
    assert first_chunk.wait(10)
    server.stop(timeout=30)  # should_exit with the stream still running; asserts the server thread ended
    reader.join(10)
    assert not reader.is_alive(), "the stream hung through shutdown"
    payloads = outcome["payloads"]
    assert payloads[-1] == "[DONE]"
    last = json.loads(payloads[-2])
    assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    scheduler = server.app.state.scheduler
    assert scheduler.draining and not scheduler.thread.is_alive() and scheduler.load == (0, 0)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_draining_server_ends_streams_past_the_grace_with_an_error_event_and_done(engine):
    """What `specdecode serve` runs: streams still going when the grace runs out, active or queued, end cleanly."""
    app = create_app(engine, replace(SETTINGS, max_active=1, shutdown_grace=0.3))
    server = RunningServer(app, DrainingServer, timeout_graceful_shutdown=5)
    first_chunk, outcomes = threading.Event(), {}

    def consume(index: int) -> None:
        body = {**LONG, "max_tokens": 8000}
        outcomes[index] = server.stream("/v1/completions", body, on_chunk=lambda _: first_chunk.set())

    readers = [threading.Thread(target=consume, args=(i,)) for i in (0, 1)]
    for reader in readers:
        reader.start()
    assert first_chunk.wait(10)
    wait = time.monotonic() + 5
    while server.health() != {"status": "ok", "active": 1, "queued": 1}:
        assert time.monotonic() < wait, server.health()
        time.sleep(0.01)
    server.stop(timeout=15)
    for reader in readers:
        reader.join(5)  # each has 7,990 tokens left to stream: ending now is shutdown's doing
        assert not reader.is_alive(), "a stream hung through shutdown"
    for payloads in outcomes.values():
        assert payloads[-1] == "[DONE]"
        assert "shut down before this request" in json.loads(payloads[-2])["error"]["message"]


def test_new_speculative_configs_from_many_threads_are_built_only_by_the_worker(engine, monkeypatch):
    """Clients asking for configurations the server has not built yet, from many threads while a stream decodes:
    the HTTP side only checks them (Engine.check_spec builds nothing), the worker thread that owns the models
    builds each drafter, and every answer is the greedy one (the same text whatever the method)."""
    fresh = Engine(engine.target, engine.draft, SETTINGS.spec)
    built_on = []
    drafter = fresh.drafter
    monkeypatch.setattr(fresh, "drafter", lambda spec: built_on.append(threading.current_thread().name) or drafter(spec))
    body = {"model": MODEL, "prompt": "hello hello hello", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    overrides = [{"method": "suffix", "suffix_max_depth": depth} for depth in range(1, 21)]
    overrides += [{"method": "auto"}, {"method": "ngram", "ngram_max": 2}, {"method": "draft", "num_draft_tokens": 5}]
    with running(create_app(fresh, SETTINGS)) as server:
        reader = threading.Thread(target=server.stream, args=("/v1/completions", {**LONG, "max_tokens": 200}))
        reader.start()
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(lambda spec: server.post("/v1/completions", {**body, "speculative": spec}),
                                    overrides))
        reader.join(60)
    assert [status for status, _ in answers] == [200] * len(overrides)
    assert len({answer["choices"][0]["text"] for _, answer in answers}) == 1
    assert built_on and set(built_on) == {"specdecode-worker"}


def test_an_idle_server_holds_no_ended_request(engine, monkeypatch):
    """Every request's caches are released when it ends, whatever the worker did last: an idle server returns to
    its starting footprint (weak references to every request begun are dead once it is idle)."""
    import gc
    import weakref

    begun = []
    begin = engine.begin
    monkeypatch.setattr(engine, "begin", lambda *args, **kwargs: begun.append(weakref.ref(r := begin(*args, **kwargs)))
                        or r)
    with running(create_app(engine, SETTINGS)) as server:
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda p: server.post("/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 6,
                                                                    "temperature": 0}), PROMPTS))
        wait_until_idle(server)
        time.sleep(0.2)  # the worker's idle loop turns over
        gc.collect()
        assert len(begun) == len(PROMPTS) and all(ref() is None for ref in begun)
