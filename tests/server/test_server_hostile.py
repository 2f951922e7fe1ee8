"""What a hostile client or a careless user sends the server (issue #63): a body cut off mid-way is a 499 that logs
no traceback, a stream its client leaves still counts the tokens it was sent, and each small mistake is a clear
400 (or, for a lower-case `bearer`, no mistake at all). Nothing here is timed: waits only wait for the server to
have noticed."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from dataclasses import replace

import pytest
from test_server import MODEL, SETTINGS, assert_openai_error, models, running  # noqa: F401 - fixture

from specdecode import Engine
from specdecode.server.app import create_app

CONTEXT = 512  # the tiny models' context


@pytest.fixture(scope="module")
def engine(models):  # noqa: F811 - the fixture imported above
    return Engine(*models, SETTINGS.spec)


@pytest.fixture(scope="module")
def served(engine):
    with running(create_app(engine, SETTINGS)) as server:
        yield server


def eventually(condition, what: str) -> None:
    """Wait for the server to have done something a client cannot be told (a hang guard, not a measurement)."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"the server never {what}"
        time.sleep(0.02)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_body_cut_off_mid_way_is_a_499_that_logs_no_traceback(served):
    path = "/v1/chat/completions"
    records = _Records()
    logging.getLogger("uvicorn.error").addHandler(records)  # where uvicorn logs an exception the app let through
    try:
        before = {status: served.metric("specdecode_requests_total", endpoint=path, status=status)
                  for status in ("499", "500")}
        with socket.create_connection(("127.0.0.1", served.port)) as client:
            client.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           "Content-Length: 1000\r\n\r\n".encode() + b'{"messages"')
        eventually(lambda: served.metric("specdecode_requests_total", endpoint=path, status="499") > before["499"],
                   "counted the hung-up body")
        assert served.metric("specdecode_requests_total", endpoint=path, status="500") == before["500"]
        assert not [record for record in records.records if record.exc_info], "a traceback was logged"
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)
    assert served.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})[0] == 200


def test_tokens_streamed_to_a_client_that_left_count_as_generated(engine, monkeypatch):
    """The worker is held after its third step until the client has gone, so it leaves mid-stream, not after."""
    left, steps = threading.Event(), []
    step_many = engine.step_many

    def held(requests):
        steps.append(len(requests))
        if len(steps) > 3:
            left.wait()
        return step_many(requests)

    monkeypatch.setattr(engine, "step_many", held)
    path = "/v1/completions"
    with running(create_app(engine, SETTINGS)) as server:
        before = server.metric("specdecode_generation_tokens_total")
        gone = server.metric("specdecode_requests_total", endpoint=path, status="499")
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", path, json.dumps({"prompt": "hello hello", "max_tokens": 200, "ignore_eos": True,
                                               "stream": True, "provenance": True}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        received = 0
        for line in response:
            if line.startswith(b"data: ") and b"specdecode" in line:
                received += len(json.loads(line[6:])["specdecode"]["tokens"])
            if received >= 2:
                break
        response.close()
        conn.close()
        left.set()
        eventually(lambda: server.metric("specdecode_requests_total", endpoint=path, status="499") > gone,
                   "noticed the client leave")
        assert server.metric("specdecode_generation_tokens_total") - before >= received >= 2


SMALL_MISTAKES = [  # (body, param, words of the message)
    ({"prompt": "hi", "top_k": 2**63}, "top_k", "less than or equal to 272"),  # the tiny vocabulary
    ({"prompt": "hi", "speculative": {"method": "draft", "draft_vocab": 10**9}}, "draft_vocab",
     "at most the target's vocabulary of 272"),
    ({"prompt": [1] * 500, "max_tokens": 100}, "max_tokens", "the prompt's 500 tokens and max_tokens 100 exceed the "
     f"context of {CONTEXT} tokens; ask for at most 12"),
    ({"prompt": []}, "prompt", "the prompt is empty"),
    ({"prompt": [1] * 40_000}, "prompt", "the prompt has 40000 tokens, which leaves no room in the context of "
     f"{CONTEXT}"),
    ({"prompt": "hi", "speculative": {"method": "ngram,"}}, None, "method 'ngram,' has an empty member"),
    ({"prompt": "hi", "speculative": {"method": "none,ngram"}}, None, "combines 'none', which drafts nothing"),
    ({"prompt": "hi", "speculative": {"method": "x" * 10_000}}, None, "(10000 characters)"),
    ({"prompt": "hi", "model": "m" * 10_000}, "model", "(10000 characters)"),
]


@pytest.mark.parametrize("body, param, words", SMALL_MISTAKES)
def test_each_small_mistake_is_one_clear_400(served, body, param, words):
    status, answer = served.post("/v1/completions", body)
    error = assert_openai_error(status, answer, 404 if "model" in body else 400)
    assert error["param"] == param and words in error["message"], error
    assert len(error["message"]) < 400  # what the client sent is not echoed back whole


def test_an_unasked_max_tokens_shrinks_to_the_room_the_prompt_leaves(served):
    status, answer = served.post("/v1/completions", {"prompt": [1] * 500, "temperature": 0, "ignore_eos": True})
    assert status == 200 and answer["usage"]["completion_tokens"] == CONTEXT - 500


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_api_keys_scheme_is_read_in_any_case(engine, scheme):
    with running(create_app(engine, replace(SETTINGS, api_key="sekret"))) as server:
        status, _ = server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2},
                                {"Authorization": f"{scheme} sekret"})
        assert status == 200
        for wrong in (f"{scheme} wrong", f"{scheme}sekret", "Basic sekret", "sekret"):
            assert_openai_error(*server.post("/v1/completions", {"prompt": "hi"}, {"Authorization": wrong}), 401)
