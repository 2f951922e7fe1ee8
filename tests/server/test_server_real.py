"""The server over the real default pair (Qwen2.5-Coder 1.5B target, 0.5B draft), through the official client."""

from __future__ import annotations

import pytest
from test_server import running

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.models.loader import load_model
from specdecode.server.app import ServerSettings, create_app

CONVERSATIONS = [
    [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is a hash map?"}],
]


@pytest.mark.real_model
def test_default_pair_served_equals_engine_and_accepts_drafts():
    engine = Engine(load_model(DEFAULT_TARGET, quiet=True), load_model(DEFAULT_DRAFT, quiet=True))
    settings = ServerSettings(model_name="qwen2.5-coder", spec=SpecConfig("ngram,draft"))
    with running(create_app(engine, settings)) as server:
        client = server.client()
        for messages in CONVERSATIONS:
            expected = engine.complete(messages, SamplingParams(max_tokens=24), settings.spec)
            response = client.chat.completions.create(model="qwen2.5-coder", messages=messages, max_tokens=24,
                                                      temperature=0)
            assert response.choices[0].message.content == expected.text
            assert response.usage.completion_tokens == len(expected.token_ids)
            stats = response.speculative
            assert stats["method"] == "ngram,draft" and 0 < stats["accepted_tokens"] <= stats["drafted_tokens"]
