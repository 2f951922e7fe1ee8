"""The server at its edges: bad bytes and shapes get OpenAI's 400 (counted in /metrics), strict types, unknown
routes, the API key's reach, the published request schemas, and logprobs as OpenAI's clients read them."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_server import MODEL, SETTINGS, assert_openai_error, models, running, stream_text  # noqa: F401 - fixture

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.server.app import create_app


@pytest.fixture(scope="module")
def engine(models):  # noqa: F811 - the fixture imported above
    return Engine(*models, SETTINGS.spec)


@pytest.fixture(scope="module")
def served(engine):
    with running(create_app(engine, SETTINGS)) as server:
        yield server


def deep(levels: int, opening: str = "[", closing: str = "]") -> str:
    return opening * levels + closing * levels


BAD_BODIES = [  # (path, raw body, param or None, a word of the message)
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "a\ud800b"}]}', None, "surrogate"),
    ("/v1/completions", rb'{"prompt": "a\ud800b", "max_tokens": 2}', None, "surrogate"),
    ("/v1/completions", rb'{"prompt": "\udfff"}', None, "surrogate"),
    ("/v1/completions", deep(10_000).encode(), None, "recursion"),
    ("/v1/completions", b'{"prompt": "hi", "user": ' + deep(10_000, "{\"a\": ", "}").encode() + b"}", None,
     "recursion"),
    ("/v1/chat/completions", b'{"messages": ' + deep(5_000).encode() + b"}", None, "recursion"),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}', "stream", "boolean"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": "8"}', "max_tokens", "integer"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 8.5}', "max_tokens", "integer"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature", "finite"),
    ("/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', "top_p", "finite"),
    ("/v1/completions", b'{"prompt": "hi", "seed": -1}', "seed", "greater than or equal to 0"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": 21}', "logprobs", "less than or equal to 20"),
    ("/v1/completions", b'{"prompt": "hi", "logprobs": true}', "logprobs", "integer"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
     "top_logprobs", "needs logprobs"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}', "logprobs",
     "boolean"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages.0.content.0.text", "string"),
    ("/v1/completions", b'{"prompt": [1, 2.5]}', "prompt.1", "integer"),
    ("/v1/completions", b"[1, 2, 3]", None, "object"),
]


@pytest.mark.parametrize("path, raw, param, word", BAD_BODIES)
def test_bad_body_is_a_counted_400_and_the_server_keeps_serving(served, path, raw, param, word):
    before = served.metric("specdecode_requests_total", endpoint=path, status="400")
    error = assert_openai_error(*served.post(path, raw), 400)
    assert error["param"] == param and word in error["message"], error
    assert served.metric("specdecode_requests_total", endpoint=path, status="400") == before + 1
    status, body = served.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("top_p", [5e-324, 1e-50])
def test_top_p_that_rounds_to_zero_answers_like_greedy(served, engine, top_p):
    expected = engine.complete("hello hello", SamplingParams(max_tokens=10, ignore_eos=True), raw=True)
    status, body = served.post("/v1/completions", {"prompt": "hello hello", "max_tokens": 10, "top_p": top_p,
                                                   "temperature": 1.0, "seed": 1, "ignore_eos": True})
    assert status == 200 and body["choices"][0]["text"] == expected.text


@pytest.mark.parametrize("method, path, status", [("GET", "/nope", 404), ("POST", "/v1/nope", 404),
                                                  ("POST", "/health", 405), ("GET", "/v1/completions", 405)])
def test_unknown_routes_and_methods_answer_in_openai_shape_and_are_counted(served, method, path, status):
    before = served.metric("specdecode_requests_total", endpoint="other", status=str(status))
    before_known = served.metric("specdecode_requests_total", endpoint=path, status=str(status))
    code, _, raw = served.request(method, path, b"{}")
    error = assert_openai_error(code, json.loads(raw), status)
    assert path in error["message"] and error["code"] in ("not_found", "method_not_allowed")
    counted = served.metric("specdecode_requests_total", endpoint="other", status=str(status)) - before
    counted += served.metric("specdecode_requests_total", endpoint=path, status=str(status)) - before_known
    assert counted == 1


@pytest.mark.parametrize("public, open_paths", [
    (None, {"/health", "/metrics", "/docs", "/openapi.json"}),  # the default: the key guards /v1 only
    ((), set()),
    (("health",), {"/health"}),
])
def test_api_key_guards_every_route_but_the_public_ones(engine, public, open_paths):
    settings = replace(SETTINGS, api_key="sekret", **({} if public is None else {"public_routes": public}))
    with running(create_app(engine, settings)) as server:
        for path in ("/health", "/metrics", "/docs", "/openapi.json", "/v1/models", "/nope"):
            status, _, raw = server.request("GET", path)
            if path in open_paths:
                assert status == 200, path
            else:
                assert assert_openai_error(status, json.loads(raw), 401)["code"] == "invalid_api_key", path
            authorized = server.request("GET", path, headers={"Authorization": "Bearer sekret"})[0]
            assert authorized == (404 if path == "/nope" else 200), path
        metrics = server.request("GET", "/metrics", headers={"Authorization": "Bearer sekret"})[2].decode()
        rejected = [line for line in metrics.splitlines() if line.startswith("specdecode_requests_total{")
                    and 'status="401"' in line]
        assert sum(float(line.split()[-1]) for line in rejected) == 6 - len(open_paths)


def test_openapi_publishes_the_request_schemas(served):
    status, _, raw = served.request("GET", "/openapi.json")
    spec = json.loads(raw)
    schemas = spec["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = spec["paths"][path]["post"]["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"]["$ref"].endswith(name)
        assert {"max_tokens", "temperature", "stream", "logprobs", "speculative"} <= set(schemas[name]["properties"])
    assert set(schemas["CompletionRequest"]["required"]) == {"prompt"}
    # `speculative`: one variant per method this server runs, each with its own options and their bounds (from
    # the registry), one without a method (the default's options), one for combinations.
    variants = schemas["SpeculativeOverride"]["oneOf"]
    by_method = {tuple(v["properties"]["method"].get("enum", ())): v["properties"] for v in variants}
    ngram = next(props for names, props in by_method.items() if "ngram" in names)
    assert ngram["ngram_branches"]["anyOf"][0] == {"type": "integer", "minimum": 1, "maximum": 8}
    assert "draft_tree_nodes" not in ngram and "ngram-simple" in next(n for n in by_method if "ngram" in n)
    assert not any("eagle3" in names for names in by_method)  # this server has no EAGLE-3 head
    assert any("pattern" in v["properties"]["method"] for v in variants)
    chat = schemas["ChatCompletionRequest"]
    assert chat["then"] == {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
    assert schemas["ChatMessage"]["properties"]["role"]["enum"][:2] == ["system", "user"]


def test_chat_logprobs_through_the_openai_client_equal_the_engines(served, engine):
    messages = [{"role": "user", "content": "abcabc"}]
    expected = engine.complete(messages, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3))
    request = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                   extra_body={"ignore_eos": True})
    response = served.client().chat.completions.create(**request)
    content = response.choices[0].logprobs.content
    assert [entry.logprob for entry in content] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-6)
    tokenizer = engine.target.tokenizer
    for entry, ours in zip(content, expected.logprobs, strict=True):
        assert bytes(entry.bytes) == tokenizer.token_bytes(ours.token_id)
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx([v for _, v in ours.top], abs=1e-6)
        assert [bytes(alt.bytes) for alt in entry.top_logprobs] == [tokenizer.token_bytes(t) for t, _ in ours.top]
    assert b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", "replace") == expected.text
    streamed = [entry for chunk in served.client().chat.completions.create(**request, stream=True)
                for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = served.client().chat.completions.create(**{**request, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_streamed_and_not_in_openai_shape(served, engine):
    body = {"model": MODEL, "prompt": "hello hello", "max_tokens": 16, "temperature": 0, "logprobs": 2,
            "ignore_eos": True, "speculative": {"method": "ngram,draft"}}
    expected = engine.complete("hello hello", SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2),
                               SpecConfig("none"), raw=True)
    status, full = served.post("/v1/completions", body)
    assert status == 200
    logprobs = full["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-5)
    assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == len(logprobs["top_logprobs"]) == 16
    for top, token, value in zip(logprobs["top_logprobs"], logprobs["tokens"], logprobs["token_logprobs"]):
        assert top[token] == value and 1 <= len(top) <= 3  # the top 2 and the chosen token, as OpenAI
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(full["choices"][0]["text"])
    chunks = [json.loads(p) for p in served.stream("/v1/completions", body)[:-1]]
    merged = {key: [v for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                    for v in c["choices"][0]["logprobs"][key]] for key in logprobs}
    assert merged == logprobs
    assert stream_text([json.dumps(c) for c in chunks] + ["[DONE]"])[0] == full["choices"][0]["text"]


def test_the_published_schema_says_what_the_server_serves(served):
    """Integral numbers are integers (JSON Schema's rule), token ids, max_tokens and draft_vocab are bounded by the
    model, every error status is documented with OpenAI's body, and /metrics is text."""
    status, answer = served.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3.0})
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    schema = json.loads(served.request("GET", "/openapi.json")[2])
    completion = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    ids = next(option for option in completion["prompt"]["anyOf"] if option.get("type") == "array")
    assert ids["items"]["exclusiveMaximum"] == 272 and ids["items"]["minimum"] == 0
    assert {"enum": [MODEL, None]}.items() <= completion["model"].items()
    override = schema["components"]["schemas"]["SpeculativeOverride"]["oneOf"]
    draft_vocab = [option for variant in override for option in variant["properties"].get("draft_vocab",
                                                                                           {}).get("anyOf", [])]
    assert draft_vocab and all(option["maximum"] == 272 for option in draft_vocab if option["type"] != "null")
    assert schema["components"]["schemas"]["ContentPart"]["properties"]["type"]["const"] == "text"
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "408", "413", "429", "500", "503"} <= responses.keys()
    assert responses["429"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
