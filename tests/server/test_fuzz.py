"""Property-based fuzzing, bounded in examples and time: the server over the request schemas it publishes
(schemathesis: no 5xx, every 4xx in OpenAI's body, still serving afterwards), the command line's parser and
checks (exit 0 or one `error:` line with 2, never a traceback), the loaders on random, truncated and edited
files (a model or one SpecDecodeError).

SPECDECODE_FUZZ_EXAMPLES scales every property (default 25 examples each; the long run in the README sets
1000).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import schemathesis
from conftest import save_tiny_model
from gguf_files import write_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from test_server import MODEL, SETTINGS, RunningServer

from specdecode import Engine, SamplingParams, SpecDecodeError
from specdecode.cli import main
from specdecode.models.loader import load_model
from specdecode.server.app import ServerSettings, create_app

EXAMPLES = int(os.environ.get("SPECDECODE_FUZZ_EXAMPLES", "25"))
BOUNDED = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 25, database=None,
                   suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return save_tiny_model(root / "target", "qwen2", scale=0.15), save_tiny_model(root / "draft", "qwen2",
                                                                                  scale=0.15, noise=0.01)


def running_server(folders, context_limit: int, request_timeout: float):
    """The tiny pair served with the fuzz settings: the context bounds how long any generated request runs, the
    timeout any hang. -> a generator for a module fixture (serves, then stops)."""
    engine = Engine(*(load_model(f, dtype="float32") for f in folders), SETTINGS.spec, context_limit=context_limit)
    settings = ServerSettings(MODEL, SETTINGS.spec, default_max_tokens=8, request_timeout=request_timeout)
    server = RunningServer(create_app(engine, settings))
    yield server
    server.stop()


def generated_from(server, modes: list[str]):
    """schemathesis over `server`'s own /openapi.json, generating in `modes`, every stream read to its end
    (schemathesis stops at 20 events by default)."""
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{server.port}/openapi.json")
    schema.config.generation.update(modes=modes, max_examples=EXAMPLES, deterministic=EXAMPLES <= 25)
    schema.config.max_stream_events = 10**6
    return schema


@pytest.fixture(scope="module")
def fuzzed_server(folders):
    yield from running_server(folders, context_limit=64, request_timeout=30.0)


@pytest.fixture(scope="module")
def published_schema(fuzzed_server):
    return generated_from(fuzzed_server, ["positive", "negative"])


fuzz_schema = schemathesis.pytest.from_fixture("published_schema")


@fuzz_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_server_answers_every_generated_request_without_a_5xx(case):
    response = case.call_and_validate(checks=[not_a_server_error], timeout=60)
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
    elif any(value.startswith("text/event-stream") for value in response.headers.get("content-type", [])):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text


@pytest.fixture(scope="module")
def roomy_server(folders):
    """The fuzzed server with room for the prompts a schema-valid request can bring (its context is what a
    token-id prompt and max_tokens are bounded by in the schema)."""
    yield from running_server(folders, context_limit=320, request_timeout=60.0)


@pytest.fixture(scope="module")
def valid_requests_schema(roomy_server):
    return generated_from(roomy_server, ["positive"])


valid_schema = schemathesis.pytest.from_fixture("valid_requests_schema")
# What a JSON schema cannot say: how many tokens a text prompt makes (its characters do not tell), a bound on the
# sum of two fields (a prompt's tokens and max_tokens within the context), and an order between two fields
# (ngram_min at most ngram_max, whose default is 4).
UNSAYABLE = ("leaves no room in the context", "exceed the context", "need 1 <= ngram_min <= ngram_max")


@valid_schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_every_request_the_schema_accepts_is_served(case):
    """Positive generation only: every request /openapi.json calls valid gets its answer (a 200 with a whole
    stream), but for what a schema cannot say (UNSAYABLE), which gets its 400."""
    response = case.call(timeout=120)
    if response.status_code == 400 and any(words in response.json()["error"]["message"] for words in UNSAYABLE):
        return
    assert response.status_code == 200, f"{case.method} {case.path} {case.body!r}: {response.text[:400]}"
    if any(value.startswith("text/event-stream") for value in response.headers.get("content-type", [])):
        assert not response.stream_cut_short
        assert response.text.rstrip().endswith("data: [DONE]"), f"{case.body!r}: {response.text[-600:]}"


def test_server_still_serves_after_the_fuzzing_and_counted_no_5xx(fuzzed_server):
    status, body = fuzzed_server.post("/v1/completions", {"prompt": "ok", "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] >= 1
    assert fuzzed_server.health()["status"] == "ok"
    text = fuzzed_server.request("GET", "/metrics")[2].decode()
    errors = [line for line in text.splitlines() if line.startswith("specdecode_requests_total{") and 'status="5' in line]
    assert all(float(line.split()[-1]) == 0 for line in errors), errors


# --- the command line ----------------------------------------------------------------------------------------

ANY_TEXT = st.text(max_size=12)  # surrogates included: what bytes that are not UTF-8 become in argv
NUMBERS = st.one_of(st.integers(-10, 10**6).map(str), st.floats(allow_nan=True).map(repr), ANY_TEXT)
FLAGS = {  # flag -> strategy for its value (None: a switch)
    "--max-tokens": NUMBERS, "--temperature": NUMBERS, "--top-k": NUMBERS, "--top-p": NUMBERS, "--min-p": NUMBERS,
    "--seed": NUMBERS, "--stop": ANY_TEXT, "--context": NUMBERS, "--num-draft-tokens": NUMBERS,
    "--spec-type": st.sampled_from(["none", "ngram", "draft", "ngram,draft", "bogus", ",", "ngram-simple"]) | ANY_TEXT,
    "--dtype": st.sampled_from(["float32", "bfloat16", "auto", "int3"]) | ANY_TEXT,
    "--device": st.sampled_from(["cpu", "cuda", "tpu", "cpu:1"]) | ANY_TEXT,
    "--quant": st.sampled_from(["none", "int8", "q9"]), "--group-size": NUMBERS,
    "--ngram-min": NUMBERS, "--ngram-max": NUMBERS, "--ngram-branches": NUMBERS, "--draft-p-min": NUMBERS,
    "--draft-tree-nodes": NUMBERS, "--draft-tree-width": NUMBERS, "--draft-model": ANY_TEXT,
    "--raw": None, "--json": None, "--ignore-eos": None, "--no-adaptive": None, "--compare-plain": None,
    "--unknown-flag": None,
}


@st.composite
def generate_argv(draw, target: str) -> list[str]:
    argv = ["generate", draw(ANY_TEXT), "--model", target, "--dtype", "float32", "--max-tokens", "8", "--quiet"]
    for flag in draw(st.lists(st.sampled_from(sorted(FLAGS)), max_size=5)):
        argv += [flag] if FLAGS[flag] is None else [flag, draw(FLAGS[flag])]
    return argv


def test_command_line_exits_0_or_with_one_error_line(folders, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("a prompt on stdin"))  # for the prompt "-"

    @BOUNDED
    @given(argv=generate_argv(str(folders[0])))
    def property(argv):
        code = main(argv)
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert code == 0 or (code == 2 and err.startswith("error: ") and err.count("\n") == 1), (argv, code, err)

    property()


# --- the loaders ---------------------------------------------------------------------------------------------

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=3), max_leaves=6)


def load_or_clear_error(path: Path) -> None:
    """The property every loader test checks: a model that generates, or one SpecDecodeError."""
    try:
        model = load_model(path, dtype="float32")
    except SpecDecodeError as error:
        assert str(error)
        return
    try:  # what loaded must generate, or say clearly why not (NaN weights cannot be sampled)
        Engine(model).complete([1, 2, 3], SamplingParams(temperature=1.0, max_tokens=4, seed=0))
    except SpecDecodeError as error:
        assert str(error)


def test_edited_config_json_loads_or_fails_clearly(folders):
    config = json.loads((folders[0] / "config.json").read_text())

    @BOUNDED
    @given(key=st.sampled_from(sorted(config)), value=JSON_VALUES, delete=st.booleans())
    def property(key, value, delete):
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(shutil.copytree(folders[0], Path(scratch) / "model"))
            edited = {k: v for k, v in config.items() if k != key} if delete else config | {key: value}
            (folder / "config.json").write_text(json.dumps(edited))
            load_or_clear_error(folder)

    property()


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "model.gguf"])
def test_random_truncated_and_flipped_files_load_or_fail_clearly(folders, tmp_path, name):
    if name == "model.gguf":
        write_gguf(tmp_path / name, folders[0], "qwen2")
        original = (tmp_path / name).read_bytes()
    else:
        original = (folders[0] / name).read_bytes()

    @BOUNDED
    @given(kind=st.sampled_from(["random", "truncated", "flipped"]), data=st.data())
    def property(kind, data):
        if kind == "random":
            content = data.draw(st.binary(max_size=4096))
        elif kind == "truncated":
            content = original[: data.draw(st.integers(0, len(original) - 1))]
        else:  # a few bytes changed anywhere: header fields, sizes, tensor data
            content = bytearray(original)
            for _ in range(data.draw(st.integers(1, 8))):
                content[data.draw(st.integers(0, len(content) - 1))] = data.draw(st.integers(0, 255))
        with tempfile.TemporaryDirectory() as scratch:
            if name == "model.gguf":
                path = Path(scratch) / name
            else:
                path = Path(shutil.copytree(folders[0], Path(scratch) / "model"))
            (path if name == "model.gguf" else path / name).write_bytes(bytes(content))
            load_or_clear_error(path)

    property()
