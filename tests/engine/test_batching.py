"""Batched steps (Engine.step_many, issue #20): padding several sequences' verify rows into one forward, caches
joined without copies, seeded sampling in a batch, drafting for a whole batch, and the server's batched
scheduler with its KV memory budget (the draft budget on scripted costs: test_load_budget.py)."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from batched_runs import run_batched
from conftest import save_tiny_model, started
from test_server import MODEL, SETTINGS, assert_openai_error, running
from torch import nn

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.engine.forward import verify_inputs
from specdecode.engine.load_budget import CATCH_UP_TOKENS
from specdecode.models.batch_invariance import batch_invariant
from specdecode.models.decoder.forward_inputs import forward_groups, padded_inputs
from specdecode.models.decoder.kv_cache import CacheBatch
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model
from specdecode.server.app import create_app
from specdecode.spec_types import DraftProposal

PROMPTS = ["hello hello hello", "abcabcabc abcabc", "The quick brown fox", "1 2 3 1 2 3 1 2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("batching")
    return (save_tiny_model(root / "target", "qwen2", scale=0.15),
            save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01))


@pytest.fixture(scope="module")
def w4a8_engine(folders):
    reason = w4a8_unavailable()
    if reason is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {reason}")
    return Engine(load_model(folders[0], dtype="bfloat16", quant="w4a8"),
                  load_model(folders[1], dtype="bfloat16", quant="w4a8"))  # a batch-invariant draft: drafts batch


def test_padded_inputs_put_each_sequence_first_and_pad_causally():
    chain = verify_inputs(7, DraftProposal.chain([1, 2, 3]), 10, "cpu")  # 4 rows
    tree = verify_inputs(7, DraftProposal(torch.tensor([4, 5]), torch.tensor([-1, -1])), 20, "cpu")  # 3 rows
    plain = verify_inputs(7, DraftProposal.empty(), 5, "cpu")  # 1 row
    batch = padded_inputs([chain, tree, plain])
    assert batch.tokens.tolist() == [[7, 1, 2, 3], [7, 4, 5, 0], [7, 0, 0, 0]]
    assert batch.positions.tolist() == [[10, 11, 12, 13], [20, 21, 21, 20], [5, 5, 5, 5]]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(batch.mask[0], causal) and torch.equal(batch.mask[2], causal)
    assert torch.equal(batch.mask[1, :3, :3], tree.mask[0])  # the tree's own ancestor mask
    assert batch.mask[1, 3].tolist() == [True, True, True, True]  # its padding row sees what a causal row does
    assert padded_inputs([chain, plain]).mask is None  # chains only: causal, no mask needed


def test_forward_groups_leave_a_sequence_without_room_for_the_padding_alone():
    # Sequence 1 has room for its own 2 rows but not for the 4 the longest brings.
    assert forward_groups([10, 50, 0], [4, 2, 1], [100, 52, 64]) == [[0, 2], [1]]
    assert forward_groups([10, 50], [4, 2], [100, 60]) == [[0, 1]]


def forward_alone_and_batched(model, prompts: list[list[int]], capacities: list[int]):
    """Each prompt prefilled in its own cache (of its own capacity), then one more row each: alone, and in one
    batched forward over the joined caches. -> (alone logits [B, V], batched logits [B, V], both cache sets)."""
    def prefilled():
        caches = [model.new_cache(capacity) for capacity in capacities]
        for ids, cache in zip(prompts, caches):
            model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), cache)
        return caches

    with torch.inference_mode():
        alone_caches, batched_caches = prefilled(), prefilled()
        alone = torch.cat([model(torch.tensor([[9]]), torch.tensor([[len(ids)]]), cache).logits[0]
                           for ids, cache in zip(prompts, alone_caches)])
        positions = torch.tensor([[len(ids)] for ids in prompts])  # [B, 1]
        batched = model(torch.full((len(prompts), 1), 9), positions, CacheBatch(batched_caches)).logits[:, 0]
    return alone, batched, alone_caches, batched_caches


PROMPT_IDS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]]


def test_w4a8_batched_forward_over_caches_of_different_capacities_is_bitwise_each_alone(w4a8_engine):
    model = w4a8_engine.target.model
    assert batch_invariant(model)
    alone, batched, alone_caches, batched_caches = forward_alone_and_batched(model, PROMPT_IDS, [16, 40, 24])
    assert torch.equal(alone, batched)
    for ours, theirs in zip(batched_caches, alone_caches):
        assert ours.lengths == theirs.lengths and torch.equal(ours.keys, theirs.keys)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float_batched_forward_over_caches_of_different_capacities_is_bitwise_each_alone(folders, dtype):
    model = load_model(folders[0], dtype=dtype).model  # fixed-order float layers (float_decoder.py)
    assert batch_invariant(model)
    alone, batched, alone_caches, batched_caches = forward_alone_and_batched(model, PROMPT_IDS, [16, 40, 24])
    assert torch.equal(alone, batched)
    for ours, theirs in zip(batched_caches, alone_caches):
        assert ours.lengths == theirs.lengths and torch.equal(ours.keys, theirs.keys)


def test_pytorch_layers_batched_forward_stacks_the_caches_and_computes_the_same_logits(folders):
    model = load_model(folders[0], dtype="float32").model
    model.layers = nn.ModuleList(layer.unfused() for layer in model.layers)  # SDPA over stacked, padded caches
    assert not batch_invariant(model)
    alone, batched, alone_caches, batched_caches = forward_alone_and_batched(model, PROMPT_IDS, [16, 40, 24])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)  # SDPA rounds with the row count
    for ours, theirs in zip(batched_caches, alone_caches):
        assert ours.lengths == theirs.lengths
        torch.testing.assert_close(ours.keys, theirs.keys, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "ngram,draft"])
def test_seeded_sampling_in_a_batch_equals_each_request_alone(w4a8_engine, monkeypatch, method):
    """With every sequence drafting what it would alone (the budget held open, no speed guard), the random
    draws are the same, so a seeded request samples the same tokens batched as alone."""
    monkeypatch.setattr(w4a8_engine.load_budget, "draft_cap", lambda seqs, wanted: max(wanted))
    spec = SpecConfig(method, num_draft_tokens=3, guard=False)
    requests = [(p, SamplingParams(max_tokens=16, temperature=1.0, seed=i, ignore_eos=True), spec)
                for i, p in enumerate(PROMPTS)]
    alone = [w4a8_engine.complete(*request).token_ids for request in requests]
    batched, shapes = run_batched(w4a8_engine, requests, join_every=1)
    assert batched == alone and max(batch for batch, _ in shapes) > 1


def test_batched_server_answers_like_single_requests_and_queues_on_its_kv_budget(w4a8_engine):
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    body = {"model": MODEL, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "speculative": {"method": "ngram"}}
    expected = {p: w4a8_engine.complete(p, sampling, SpecConfig("ngram"), raw=True).text for p in PROMPTS}
    one_request = w4a8_engine.request_cache_bytes(len(w4a8_engine.encode(PROMPTS[0], raw=True)) + 8, sampling,
                                                  SpecConfig("ngram"))
    settings = replace(SETTINGS, kv_memory=2 * one_request + one_request // 2)  # room for two at a time
    with running(create_app(w4a8_engine, settings)) as server:
        scheduler = server.app.state.scheduler
        assert scheduler.batching  # auto: a w4a8 target batches
        most_active = []
        watching = threading.Event()

        def watch():
            while not watching.is_set():
                most_active.append(scheduler.load[0])
                watching.wait(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(lambda p: server.post("/v1/completions", {**body, "prompt": p}), PROMPTS * 2))
        watching.set()
        watcher.join()
        for prompt, (status, answer) in zip(PROMPTS * 2, answers):
            assert status == 200 and answer["choices"][0]["text"] == expected[prompt]
        assert max(most_active) == 2  # the budget held two at a time; the rest waited, none failed
        assert server.metric("specdecode_kv_cache_budget_bytes") == settings.kv_memory
        too_big = {**body, "prompt": PROMPTS[0], "max_tokens": 400}  # more than the whole budget
        error = assert_openai_error(*server.post("/v1/completions", too_big), 400)
        assert "KV cache needs" in error["message"] and error["param"] == "max_tokens"
        assert json.loads(json.dumps(server.health()))["active"] == 0


def test_load_bench_runs_clients_concurrently_and_reports_percentiles(w4a8_engine, tmp_path, monkeypatch):
    from specdecode.bench import load
    from specdecode.bench.datasets import load_questions
    from specdecode.bench.load import run_load_bench

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"question_id": i, "category": "t", "turns": [p]}) + "\n"
                               for i, p in enumerate(PROMPTS * 2)))
    sampling = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with running(create_app(w4a8_engine, SETTINGS)) as server:
        url = f"http://127.0.0.1:{server.port}"
        peers = [f"openai={url},name=ours", f"openai={url},name=ours-plain,spec=none,cache=on"]
        sent = []  # (the speculative override, cache_prompt) of every request
        streamed = load.stream_chat
        monkeypatch.setattr(load, "stream_chat",
                            lambda url, body: sent.append((str(body.get("speculative")), body["cache_prompt"]))
                            or streamed(url, body))
        results = run_load_bench(peers, load_questions([str(dataset)]), sampling, [1, 4], tmp_path)
    # Cold prompts unless a peer says otherwise (llama.cpp answers prompts it saw before from its cache).
    assert sorted(set(sent)) == [("None", False), ("{'method': 'none'}", True)] and len(sent) == 4 * 8
    assert [(r.server, r.concurrency) for r in results] == [("ours", 1), ("ours", 4), ("ours-plain", 1),
                                                            ("ours-plain", 4)]
    for r in results:
        assert r.requests == 8 and r.failed == 0 and r.output_tokens > 8 and r.tokens_per_second > 0
        assert set(r.ttft_ms) == set(r.itl_ms) == {"p50", "p90", "p99"}
        assert r.ttft_ms["p50"] <= r.ttft_ms["p90"] <= r.ttft_ms["p99"]
    assert json.loads((tmp_path / "results.json").read_text())[1]["concurrency"] == 4
    report = (tmp_path / "report.md").read_text()
    assert "| ours-plain | 4 |" in report and "prompts cold (`cache_prompt: false`) except to ours-plain" in report


def test_load_bench_without_a_server_is_one_clear_error(tmp_path, capsys):
    from specdecode.cli.main import main

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text(json.dumps({"question_id": 1, "category": "t", "turns": ["hi"]}) + "\n")
    assert main(["bench", "--dataset", str(dataset), "--concurrency", "1,2"]) != 0
    assert "--concurrency loads servers" in capsys.readouterr().err
    assert main(["bench", "--dataset", str(dataset), "--concurrency", "1", "--peer", "openai=http://x,cache=1"]) != 0
    assert "cache= takes on or off" in capsys.readouterr().err


@pytest.mark.parametrize("options, combine", [({}, "first"), ({"draft_p_min": 0.3}, "first"), ({}, "best")])
def test_a_w4a8_draft_model_drafts_for_the_whole_batch_in_shared_forwards(w4a8_engine, monkeypatch, options, combine):
    """Catch-up and each drafted position run once for every sequence drafting (not once per sequence), and the
    chains are what each drafts alone, so outputs stay equal (greedy here; seeded sampling above). With per-step
    choice (`auto`'s rule) too: the requests that chose the draft model draft together."""
    monkeypatch.setattr(w4a8_engine.load_budget, "draft_cap", lambda seqs, wanted: max(wanted))
    draft_model = w4a8_engine.draft.model
    batches = []
    forward = draft_model.forward

    def recording(tokens, *args, **kwargs):
        batches.append(tokens.shape[0])
        return forward(tokens, *args, **kwargs)

    spec = SpecConfig("ngram,draft", num_draft_tokens=3, options=options, combine=combine, guard=False)
    if combine == "best":  # the choice rests on timings: here the draft model always promises the most
        chooser = w4a8_engine.drafter(spec).chooser
        # (expected tokens, seconds): the draft model's promise infinite, every other member's zero
        monkeypatch.setattr(chooser, "expected", lambda member, *args: (1.0, 0.0) if member == "draft" else (0.0, 1.0))
        monkeypatch.setattr(chooser, "needs_evidence", lambda member: False)
    requests = [(p, SamplingParams(max_tokens=20, ignore_eos=True), spec) for p in PROMPTS]
    alone = [w4a8_engine.complete(*request).token_ids for request in requests]
    monkeypatch.setattr(draft_model, "forward", recording)
    batched, _ = run_batched(w4a8_engine, requests, join_every=1)
    assert batched == alone
    assert max(batches) > 1, "the draft model never ran a batch"


def test_a_draft_model_asked_for_no_tokens_in_a_batch_proposes_nothing(w4a8_engine):
    """In a chain, an earlier member may have drafted for every sequence of the batch; the draft model is then
    asked for nothing (this once ended every request of the batch with an error)."""
    seqs = [started(w4a8_engine, w4a8_engine.encode(p), SamplingParams(max_tokens=8), SpecConfig("ngram,draft"))
            for p in PROMPTS[:2]]
    drafter = seqs[0].drafter.members[1]
    assert drafter.name == "draft" and drafter.batch_invariant
    assert [p.tokens.numel() for p in drafter.propose_many(seqs, [0, 0])] == [0, 0]
    for seq in seqs:
        w4a8_engine.finish(seq)


def test_a_draft_model_that_reads_the_prompt_at_start_prices_its_catch_ups_there(w4a8_engine):
    """Before any batched step: `draft` reads the prompt when it starts, so its method's catch-ups are priced
    at once; a chain with per-step choice defers that read, and its catch-ups are priced at the target's prefill
    until one is measured."""
    engine = Engine(w4a8_engine.target, w4a8_engine.draft)
    prompt = [5 + i % 50 for i in range(CATCH_UP_TOKENS + 8)]
    for spec in (SpecConfig("draft"), SpecConfig("ngram,draft", combine="best")):
        engine.finish(started(engine, engine.encode(prompt), SamplingParams(max_tokens=4), spec))
    assert engine.load_budget._methods["draft"].catch_up_seconds_per_token > 0
    assert engine.load_budget._methods["ngram,draft"].catch_up_seconds_per_token is None
    assert engine.load_budget.prefill_seconds_per_token > 0  # ... priced meanwhile at the target's prefill


def test_a_bug_in_one_prefill_is_a_500_for_that_request_and_the_server_keeps_serving(w4a8_engine, monkeypatch):
    prefill = w4a8_engine.prefill
    calls = []

    def failing_once(request, tokens):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a scripted bug")
        return prefill(request, tokens)

    monkeypatch.setattr(w4a8_engine, "prefill", failing_once)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    with running(create_app(w4a8_engine, SETTINGS)) as server:
        error = assert_openai_error(*server.post("/v1/completions", body), 500)
        assert "a scripted bug" in error["message"]
        status, answer = server.post("/v1/completions", body)
        assert status == 200 and answer["usage"]["completion_tokens"] == 8
