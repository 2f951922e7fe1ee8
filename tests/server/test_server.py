"""The OpenAI-compatible server as clients meet it: the official client, raw HTTP, streaming, errors, metrics.

Every app runs in-process on a free 127.0.0.1 port under uvicorn in a background thread.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest
import uvicorn
from conftest import save_tiny_model
from openai import AuthenticationError, BadRequestError, NotFoundError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.cli import main
from specdecode.cli.serve import spec_from_vllm
from specdecode.drafters.registry import resolve_spec
from specdecode.models.loader import load_model
from specdecode.server.app import DrainingServer, ServerSettings, create_app

MODEL = "tiny-qwen2"
SETTINGS = ServerSettings(model_name=MODEL, spec=SpecConfig("ngram,draft"))
PROMPTS = ["hello hello hello", "abcabcabc", "hi", "ok"]  # prompts the tiny model answers differently


class RunningServer:
    """uvicorn serving `app` on a free local port from a daemon thread."""

    def __init__(self, app, server_class=uvicorn.Server, **config):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.app = app
        self.server = server_class(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                  **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)

    def stop(self, timeout: float = 20) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not stop"

    def client(self, api_key: str = "x") -> OpenAI:
        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=api_key, max_retries=0, timeout=60)

    def request(self, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        status, response_headers, raw = response.status, dict(response.getheaders()), response.read()
        conn.close()
        return status, response_headers, raw

    def post(self, path: str, body, headers: dict | None = None) -> tuple[int, dict]:
        status, _, raw = self.request("POST", path, body, headers)
        return status, json.loads(raw)

    def stream(self, path: str, body: dict, on_chunk=None) -> list[str]:
        """The `data:` payloads of one SSE response, in order; on_chunk(payload) sees each as it arrives."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        payloads = []
        for line in response:
            if line.startswith(b"data: "):
                payloads.append(line[6:].strip().decode())
                if on_chunk:
                    on_chunk(payloads[-1])
        conn.close()
        return payloads

    def health(self) -> dict:
        return json.loads(self.request("GET", "/health")[2])

    def metric(self, name: str, **labels) -> float:
        text = self.request("GET", "/metrics")[2].decode()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and labels.items() <= sample.labels.items())


@contextmanager
def running(app):
    server = RunningServer(app)
    try:
        yield server
    finally:
        server.stop()


def stream_text(payloads: list[str]) -> tuple[str, str | None, dict | None]:
    """Reassembled text, the finish reason and the usage chunk of a completed SSE stream."""
    assert payloads[-1] == "[DONE]"
    text, finish, usage_chunk = [], None, None
    for chunk in map(json.loads, payloads[:-1]):
        assert "error" not in chunk, chunk
        if chunk.get("usage"):
            usage_chunk = chunk
        for choice in chunk["choices"]:
            text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
            finish = choice["finish_reason"] or finish
    return "".join(text), finish, usage_chunk


def assert_speculative_consistent(spec: dict, method: str, completion_tokens: int) -> None:
    assert spec["method"] == method
    assert 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]
    assert spec["mean_accepted_length"] >= 1
    assert sum(spec["accepted_per_position"]) == spec["accepted_tokens"]
    assert spec["target_forwards"] < completion_tokens  # prefill makes the first token, every verify one or more


def assert_openai_error(status: int, body: dict, expected_status: int) -> dict:
    assert status == expected_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    return body["error"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    target = save_tiny_model(root / "target", "qwen2", scale=0.15)
    draft = save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01)
    return load_model(target, dtype="float32"), load_model(draft, dtype="float32")


@pytest.fixture(scope="module")
def engine(models):
    return Engine(*models, SETTINGS.spec)


@pytest.fixture(scope="module")
def served(engine):
    with running(create_app(engine, SETTINGS)) as server:
        yield server


def greedy(engine: Engine, prompt, max_tokens: int = 16, **sampling):
    return engine.complete(prompt, SamplingParams(max_tokens=max_tokens, **sampling), raw=isinstance(prompt, str))


def test_completion_equals_engine_output_with_usage_and_speculative_stats(served, engine):
    expected = greedy(engine, PROMPTS[0])
    response = served.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    choice = response.choices[0]
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert response.usage.prompt_tokens == len(engine.encode(PROMPTS[0], raw=True))
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens
    assert_speculative_consistent(response.speculative, "ngram,draft", len(expected.token_ids))
    assert response.speculative["drafted_tokens"] > 0


def test_chat_completion_equals_engine_output(served, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[1]}]
    expected = greedy(engine, messages, max_tokens=12)
    response = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                        temperature=0)
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(engine.encode(messages))
    assert response.usage.completion_tokens == len(expected.token_ids)


def test_null_fields_and_text_content_parts_are_accepted_as_other_servers_do(served, engine):
    messages = [{"role": "user", "content": PROMPTS[1]}]
    expected = greedy(engine, messages, max_tokens=8)
    status, body = served.post("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 8, "temperature": 0, "top_p": None, "stop": None,
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPTS[1]}]}]})
    assert status == 200 and body["choices"][0]["message"]["content"] == expected.text
    status, body = served.post("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    assert_openai_error(status, body, 400)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_text_equals_non_streamed_and_ends_with_usage_and_done(served, chat):
    client, request = served.client(), dict(model=MODEL, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    if chat:
        request["messages"] = [{"role": "user", "content": PROMPTS[2]}]
        full = client.chat.completions.create(**request)
        full_text = full.choices[0].message.content
        chunks = list(client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        request["prompt"] = PROMPTS[2]
        full = client.completions.create(**request)
        full_text = full.choices[0].text
        chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full_text and [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16 == full.usage.completion_tokens
    assert_speculative_consistent(chunks[-1].speculative, "ngram,draft", 16)
    raw = served.stream("/v1/chat/completions" if chat else "/v1/completions",
                        {k: v for k, v in request.items() if k != "extra_body"} | {"ignore_eos": True})
    assert stream_text(raw)[:2] == (full_text, "length")


def test_max_tokens_and_max_completion_tokens_bound_the_output(served):
    client, ignore_eos = served.client(), {"ignore_eos": True}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                          max_completion_tokens=5, extra_body=ignore_eos)
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=7, temperature=0, extra_body=ignore_eos)
    assert completion.usage.completion_tokens == 7 and completion.choices[0].finish_reason == "length"


def test_stop_strings_cut_the_text(served):
    client, request = served.client(), dict(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
    full = client.completions.create(**request).choices[0].text
    first, *later = [ch for ch in full[1:] if ch.isascii() and ch.isprintable()]
    second = next(ch for ch in later if ch != first)
    single = client.completions.create(**request, stop=first).choices[0]
    assert single.text == full[: full.index(first)] and single.finish_reason == "stop"
    listed = client.completions.create(**request, stop=["never appears", second]).choices[0]
    assert listed.text == full[: full.index(second)] and listed.finish_reason == "stop"


def test_seed_makes_sampling_reproducible(served):
    client = served.client()

    def sample(seed: int) -> str:
        response = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=1.5,
                                             seed=seed, extra_body={"ignore_eos": True})
        return response.choices[0].text

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1


def test_every_answer_says_its_seed_which_reproduces_it_with_any_method(served):
    """A request without a seed gets one picked and returned; under the coupled rule (every request has a seed)
    that seed gives the same answer again, through plain decoding and through another drafter alike."""
    client = served.client()

    def sample(**extra) -> tuple[str, dict]:
        response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=1.0,
                                             extra_body={"ignore_eos": True, **extra})
        return response.choices[0].text, response.speculative

    text, speculative = sample()
    assert isinstance(speculative["seed"], int) and speculative["verification"] == "coupled"
    assert speculative["drafted_tokens"] > 0
    for method in ("none", "draft"):
        again, replayed = sample(seed=speculative["seed"], speculative={"method": method})
        assert again == text and replayed["seed"] == speculative["seed"]
    assert sample()[1]["seed"] != speculative["seed"]  # picked afresh for each request


def test_top_k_one_and_high_min_p_sample_like_greedy(served, engine):
    expected = greedy(engine, PROMPTS[0]).text
    client = served.client()
    for extra in ({"top_k": 1}, {"min_p": 0.999}):
        response = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=1.0,
                                             seed=3, extra_body=extra)
        assert response.choices[0].text == expected, extra


@pytest.mark.parametrize("override, method", [({"method": "none"}, "none"), ({"method": "draft"}, "draft"),
                                              ({"method": "ngram", "num_draft_tokens": 2}, "ngram")])
def test_per_request_speculative_override_keeps_the_output(served, engine, override, method):
    expected = greedy(engine, PROMPTS[2], max_tokens=20, ignore_eos=True)
    response = served.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20, temperature=0,
                                                  extra_body={"speculative": override, "ignore_eos": True})
    assert response.choices[0].text == expected.text
    stats = response.speculative
    assert_speculative_consistent(stats, method, 20)
    if method == "none":
        assert stats["drafted_tokens"] == 0 and stats["mean_accepted_length"] == 1
    else:
        assert stats["drafted_tokens"] > 0
        assert len(stats["accepted_per_position"]) <= override.get("num_draft_tokens", 64)


def test_n_above_one_is_a_clear_400(served):
    with pytest.raises(BadRequestError) as caught:
        served.client().completions.create(model=MODEL, prompt="hi", n=2, max_tokens=4)
    assert caught.value.status_code == 400 and caught.value.body["param"] == "n" and "should be 1" in caught.value.message


def test_models_health_and_metrics_endpoints(served):
    assert [m.id for m in served.client().models.list()] == [MODEL]
    assert served.health() == {"status": "ok", "active": 0, "queued": 0}
    status, headers, raw = served.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("specdecode_requests_total", "specdecode_generation_tokens_total",
                 "specdecode_spec_drafted_tokens_total", "specdecode_time_to_first_token_seconds_bucket",
                 "specdecode_active_requests", "specdecode_queued_requests", "specdecode_request_memory_bytes_bucket",
                 "specdecode_drafter_cache_bytes"):
        assert name.encode() in raw
    weights = [line for line in raw.decode().splitlines() if line.startswith('specdecode_weights_bytes{model="target"}')]
    assert len(weights) == 1 and float(weights[0].split()[-1]) > 0


BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400, None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4o"}, 404, "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt.2"),  # beyond the vocabulary, as the schema says
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "speculative": {"method": "telepathy"}}, 400, None),
    ("/v1/completions", {"prompt": "hi", "speculative": {"k": 3}}, 400, "speculative.k"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop.0"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_REQUESTS)
def test_bad_request_gets_openai_error_and_server_keeps_serving(served, path, body, status, param):
    error = assert_openai_error(*served.post(path, body), status)
    assert error["param"] == param
    response = served.client().completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0)
    assert response.usage.completion_tokens >= 1


def test_unknown_model_is_not_found_through_the_client(served):
    with pytest.raises(NotFoundError) as caught:
        served.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found"


def test_prompt_over_small_context_is_rejected_and_default_max_tokens_fits(models):
    with running(create_app(Engine(*models, context_limit=64), SETTINGS)) as server:
        error = assert_openai_error(*server.post("/v1/completions", {"prompt": "x" * 100}), 400)
        assert "context" in error["message"]
        assert_openai_error(*server.post("/v1/completions", {"prompt": "hi", "max_tokens": 65}), 400)
        # No max_tokens: the default (256) must not turn every request into an error on a small context.
        status, body = server.post("/v1/completions", {"prompt": "hi", "temperature": 0, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == 64


def test_oversized_body_is_413(engine):
    with running(create_app(engine, replace(SETTINGS, max_body_bytes=256))) as server:
        error = assert_openai_error(*server.post("/v1/completions", {"prompt": "x" * 300}), 413)
        assert error["code"] == "request_too_large"
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)  # chunked: no Content-Length
        conn.request("POST", "/v1/completions", iter([b'{"prompt": "', b"x" * 300, b'"}']), encode_chunked=True,
                     headers={"Content-Type": "application/json"})
        assert conn.getresponse().status == 413
        conn.close()
        assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})[0] == 200


def test_api_key_guards_v1_routes_but_not_health(engine):
    with running(create_app(engine, replace(SETTINGS, api_key="sekret"))) as server:
        with pytest.raises(AuthenticationError):
            server.client(api_key="wrong").models.list()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            error = assert_openai_error(*server.post("/v1/completions", {"prompt": "hi"}, headers), 401)
            assert error["code"] == "invalid_api_key"
        assert server.health()["status"] == "ok"
        good = server.client(api_key="sekret")
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_spec_from_vllm_maps_methods_and_rejects_bad_config():
    base = SpecConfig("ngram,draft")
    spec, draft = spec_from_vllm('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}', base)
    assert (spec.method, spec.num_draft_tokens, spec.option("ngram_max"), draft) == ("ngram", 5, 3, None)
    spec, draft = spec_from_vllm('{"method": "draft_model", "model": "x"}', base)
    assert (spec.method, spec.num_draft_tokens, draft) == ("draft", 3, "x")
    assert spec_from_vllm('{"model": "y"}', base) == (replace(base, method="draft"), "y")
    for bad in ("{method: ngram", '["ngram"]', '{"method": "eagle"}', "{}"):
        with pytest.raises(SpecDecodeError):
            spec_from_vllm(bad, base)
    assert resolve_spec(SpecConfig("ngram-simple")).method == "ngram"  # llama.cpp's name
    with pytest.raises(SpecDecodeError, match="wrong type"):
        spec_from_vllm('{"method": "ngram", "num_speculative_tokens": "x"}', base)


def test_serve_command_maps_llama_cpp_spec_type(models, monkeypatch):
    configs = []
    monkeypatch.setattr(DrainingServer, "run", lambda server, sockets=None: configs.append(server.config))
    target_folder = str(models[0].folder)
    assert main(["serve", "--model", target_folder, "--spec-type", "ngram-simple", "--dtype", "float32", "--port", "0",
                 "--served-model-name", "m", "--num-draft-tokens", "5"]) == 0
    (config,) = configs
    engine = config.app.state.scheduler.engine
    assert engine.spec.method == "ngram" and engine.spec.num_draft_tokens == 5 and engine.draft is None
    assert config.host == "127.0.0.1" and config.timeout_graceful_shutdown == 15
    assert main(["serve", "--model", target_folder, "--speculative-config", '{"method": "medusa"}']) == 2
