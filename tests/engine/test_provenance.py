"""Where each token came from (engine/provenance.py): every event's origins agree with what the engine committed,
over chains, trees and combinations; `generate --json` and `--show-drafts` carry them; the server's chunks carry
them under "specdecode" when asked, and the official client still reads the stream."""

from __future__ import annotations

import json

import pytest
from test_server import MODEL, SETTINGS, models, running  # noqa: F401 - fixture

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.main import main
from specdecode.server.app import create_app

SAMPLING = SamplingParams(max_tokens=40, ignore_eos=True)
SPECS = {"plain": SpecConfig("none"), "ngram": SpecConfig("ngram", guard=False),
         "draft": SpecConfig("draft", guard=False), "draft tree": SpecConfig("draft", guard=False, draft_tree_nodes=6),
         "suffix tree": SpecConfig("suffix", guard=False, suffix_tree_nodes=6),
         "ngram,draft": SpecConfig("ngram,draft", guard=False)}


@pytest.fixture(scope="module")
def engine(noisy_pair):
    return Engine(*noisy_pair)


def depth_of(node: int, parents: list[int] | None) -> int:
    if parents is None:
        return node + 1
    return 1 if parents[node] < 0 else 1 + depth_of(parents[node], parents)


@pytest.mark.parametrize("name", SPECS)
def test_every_tokens_origin_is_what_its_step_committed(engine, name):
    spec = SPECS[name]
    events = list(engine.generate("hello hello hello abc abc", SAMPLING, spec, provenance=True))
    first = events[0]
    assert [o.kind for o in first.origins] == ["target"] and first.step is None
    accepted = 0
    for event in events[1:]:
        origins, step = event.origins, event.step
        assert len(origins) == len(event.token_ids) and all(o.step == step.step for o in origins)
        drafts = [o for o in origins if o.kind == "draft"]
        assert [o.position for o in drafts] == list(range(1, len(drafts) + 1)) and len(drafts) == step.accepted
        assert all(o.method == step.method for o in drafts)
        if not step.drafted:
            assert [o.kind for o in origins] == ["target"]
        else:
            # The accepted tokens are drafted nodes, each the child of the one before (a path from the root).
            path_tokens = event.token_ids[: step.accepted]
            assert all(token in step.drafted for token in path_tokens)
            depths = [depth_of(node, step.parents) for node in range(len(step.drafted))]
            deepest_kept = step.accepted == max(depths) if step.parents is None else None
            last = origins[-1].kind
            assert last in ("bonus", "corrected")
            if step.parents is None:  # a chain: the bonus comes after every drafted token was accepted
                assert (last == "bonus") == deepest_kept
        accepted += len(drafts)
    assert accepted == events[-1].stats.accepted_tokens
    if name != "plain":
        assert accepted > 0, "nothing was accepted: the test would check nothing"


def test_generate_json_and_show_drafts(models, capsys):
    target, draft = (str(model.folder) for model in models)
    argv = ["generate", "hello hello hello", "--model", target, "--draft-model", draft, "--dtype", "float32",
            "--spec-type", "ngram", "--max-tokens", "24", "--ignore-eos"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["origins"]) == len(report["token_ids"]) and report["steps"]
    assert {o["kind"] for o in report["origins"]} <= {"draft", "bonus", "corrected", "target"}
    assert main([*argv, "--show-drafts"]) == 0
    captured = capsys.readouterr()
    assert "\033[32m" in captured.out and "accepted draft" in captured.err


def test_the_server_streams_provenance_and_the_official_client_still_reads_it(models):
    engine = Engine(*models, SETTINGS.spec)
    with running(create_app(engine, SETTINGS)) as server:
        payloads = server.stream("/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "hello hello hello"}], "max_tokens": 16,
            "temperature": 0, "provenance": True, "speculative": {"method": "ngram"}})
        chunks = [json.loads(p) for p in payloads[:-1]]
        tokens = [t for c in chunks if "specdecode" in c for t in c["specdecode"]["tokens"]]
        assert len(tokens) == 16 and {"id", "bytes", "kind", "method", "position", "step"} <= tokens[0].keys()
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        assert bytes(b for t in tokens if not t["special"] for b in t["bytes"]).decode("utf-8", "replace") == text
        client = server.client()
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, stream=True, extra_body={"provenance": True})
        assert sum(1 for _ in stream) > 1
        plain = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0})
        assert "specdecode" not in plain[1]  # only when asked
        full = server.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8, "temperature": 0,
                                               "provenance": True})[1]
        assert len(full["specdecode"]["tokens"]) == full["usage"]["completion_tokens"]
