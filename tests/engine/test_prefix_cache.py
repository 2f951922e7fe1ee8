"""Ended requests' KV caches reused by later prompts with the same beginning (prefix_cache.py): what a hit puts
in the cache is what reading the prompt whole would, entries stay within their budget, a chat's later turn
replaces its earlier entry, and a client can ask for a cold read."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import save_tiny_model, started
from mtp_reference import add_mtp_layers
from test_server import MODEL, SETTINGS, running

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.serve import parse_size_or_off
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.engine.prefix_cache import PrefixCache
from specdecode.errors import SpecDecodeError
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model
from specdecode.server.app import create_app

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    reason = w4a8_unavailable()
    if reason is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {reason}")
    folder = save_tiny_model(tmp_path_factory.mktemp("prefix-cache") / "target", "qwen2", scale=0.15)
    return load_model(folder, dtype="bfloat16", quant="w4a8")


def answered(engine: Engine, ids: list[int], spec: SpecConfig = SpecConfig("none")) -> list[int]:
    seq = started(engine, ids, GREEDY, spec)
    while seq.generated < GREEDY.max_tokens:
        engine.step(seq)
    engine.finish(seq)
    return seq.tokens[seq.prompt_len:]


def test_a_hit_fills_the_cache_as_reading_the_prompt_whole_does(target):
    """Bitwise on a w4a8 target: keys, values and positions of every prompt row, and the first token's logits."""
    cached = Engine(target, prefix_cache_bytes=2**24)
    first = cached.encode("The quick brown fox")
    second = first + answered(cached, first) + cached.encode(" jumps over", raw=True)
    hit = cached.begin(second, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3), SpecConfig("none"),
                       chunk=3)  # the rest read in chunks, as the server does while others decode
    cold_engine = Engine(target)
    cold = cold_engine.begin(second, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3), SpecConfig("none"))
    assert hit.stats.cached_prompt_tokens == len(first) + GREEDY.max_tokens - 1
    assert hit.cache.lengths[0] == hit.stats.cached_prompt_tokens and cold.cache.lengths[0] == 0
    while cached.prefill(hit) is None:
        pass
    cold_engine.prefill(cold)
    length = len(second)
    assert hit.cache.lengths == cold.cache.lengths == [length]
    assert torch.equal(hit.cache.keys[:, :, :, :length], cold.cache.keys[:, :, :, :length])
    assert torch.equal(hit.cache.values[:, :, :, :length], cold.cache.values[:, :, :, :length])
    assert torch.equal(hit.cache.positions[:, :length], cold.cache.positions[:, :length])
    assert hit.tokens == cold.tokens and hit.logprobs == cold.logprobs


def test_the_same_prompt_again_reads_only_its_last_token(target):
    engine = Engine(target, prefix_cache_bytes=2**24)
    ids = engine.encode("hello hello hello")
    assert engine.complete(ids, GREEDY).stats.cached_prompt_tokens == 0
    again = engine.complete(ids, GREEDY)
    assert again.stats.cached_prompt_tokens == len(ids) - 1  # its logits sample the first token
    assert again.token_ids == Engine(target).complete(ids, GREEDY).token_ids


def test_a_client_may_ask_for_a_cold_read(target):
    engine = Engine(target, prefix_cache_bytes=2**24)
    ids = engine.encode("hello hello hello")
    answered(engine, ids)
    request = engine.begin(ids, GREEDY, SpecConfig("none"), reuse_prefix=False)
    assert request.cache.lengths[0] == 0 and request.stats.cached_prompt_tokens == 0


def test_a_chats_later_turn_replaces_its_earlier_entry(target):
    engine = Engine(target, prefix_cache_bytes=2**24)
    turn = engine.encode("abcabcabc abcabc")
    for _ in range(3):
        turn = turn + answered(engine, turn) + engine.encode(" and again", raw=True)
        assert engine.prefix_cache.entries == 1  # the prompt's entry at start, then prompt and answer at the end
    ended = engine.prefix_cache._entries[0]
    assert ended.tokens.numel() == len(turn) - len(engine.encode(" and again", raw=True)) - 1


def test_a_request_whose_step_failed_after_its_forward_leaves_nothing_of_that_step(target):
    """Rows a failed step wrote but never committed must not be offered to later prompts."""
    engine = Engine(target, prefix_cache_bytes=2**24)
    ids = engine.encode("hello hello hello")
    seq = started(engine, ids, GREEDY, SpecConfig("none"))
    engine.step(seq)
    seq.cache.advance(3)  # as a verify forward that raised before its commit leaves the cache
    engine.finish(seq)
    assert engine.prefix_cache.entries == 1 and engine.prefix_cache._entries[0].tokens.numel() == len(ids)


def test_entries_stay_within_the_budget_least_recently_used_first_out(target):
    probe = Engine(target, prefix_cache_bytes=2**24)
    prompts = [probe.encode(text, raw=True) for text in ("aaa bbb ccc", "ddd eee fff", "ggg hhh iii")]
    answered(probe, prompts[0])
    budget = probe.prefix_cache.nbytes * 2 + 1  # two such entries, not three
    engine = Engine(target, prefix_cache_bytes=budget)
    for ids in prompts:
        answered(engine, ids)
        assert engine.prefix_cache.nbytes <= budget
    assert engine.prefix_cache.entries == 2
    assert engine.complete(prompts[0], GREEDY).stats.cached_prompt_tokens == 0  # the oldest went first
    assert engine.complete(prompts[2], GREEDY).stats.cached_prompt_tokens == len(prompts[2]) - 1


def test_a_drafter_that_reads_hidden_states_reuses_only_entries_that_kept_them(target, tmp_path):
    """An entry made by a request whose drafter read no hidden states gives MTP nothing; one made by MTP gives it
    every row, the answer's too, and serves a plain request as well."""
    folder = save_tiny_model(tmp_path / "mtp-target", "qwen2", scale=0.15)
    add_mtp_layers(folder, "deepseek", follow=1.0)
    engine = Engine(load_model(folder, dtype="bfloat16", quant="w4a8"), prefix_cache_bytes=2**24)
    first = engine.encode("1 2 3 1 2 3 1 2")
    plain_answer = answered(engine, first)
    second = first + plain_answer + engine.encode(" 3", raw=True)
    assert engine.begin(second, GREEDY, SpecConfig("mtp")).stats.cached_prompt_tokens == 0
    assert answered(engine, first, SpecConfig("mtp")) == plain_answer
    kept = len(first) + len(plain_answer) - 1  # the answer's last token never went through the target
    assert engine.prefix_cache.entries == 1  # the MTP entry replaced the plain one: same tokens, more states
    for method in ("mtp", "none"):
        assert engine.begin(second, GREEDY, SpecConfig(method)).stats.cached_prompt_tokens == kept


def test_a_drafter_started_from_a_hit_gets_the_states_a_whole_read_gives(target, tmp_path, monkeypatch):
    """Bitwise on a w4a8 target: every row's hidden states MTP starts from, the first turn's answer rows included
    (they come from its verify forwards, kept as its steps committed them)."""
    folder = save_tiny_model(tmp_path / "mtp-target", "qwen2", scale=0.15)
    add_mtp_layers(folder, "deepseek", follow=1.0)
    mtp_target = load_model(folder, dtype="bfloat16", quant="w4a8")
    spec = SpecConfig("mtp", num_draft_tokens=2)

    def started_with(engine: Engine, ids: list[int]):
        seen = []
        drafter = engine.drafter(spec)
        start = drafter.start
        monkeypatch.setattr(drafter, "start", lambda seq, prefill: seen.append(prefill) or start(seq, prefill))
        reused = started(engine, ids, GREEDY, spec).stats.cached_prompt_tokens
        return seen[0], reused

    cached = Engine(mtp_target, prefix_cache_bytes=2**24)
    first = cached.encode("1 2 3 1 2 3 1 2")
    second = first + answered(cached, first, spec) + cached.encode(" 3", raw=True)
    (hit, reused), (cold, _) = started_with(cached, second), started_with(Engine(mtp_target), second)
    assert reused == len(second) - 3 and hit.final_hidden.shape[0] == len(second)  # unread: " 3", the answer's last
    assert torch.equal(hit.final_hidden, cold.final_hidden)
    assert hit.hidden.keys() == cold.hidden.keys()
    assert all(torch.equal(hit.hidden[layer], cold.hidden[layer]) for layer in hit.hidden)
    assert torch.equal(hit.logits, cold.logits)


def test_a_draft_model_starts_from_its_own_cached_rows(target, tmp_path, monkeypatch):
    """The draft model's KV rows are kept with the target's: a hit hands them to its start, which reads only the
    rest, and its cache then holds bitwise what a whole read gives (w4a8 draft)."""
    draft = load_model(save_tiny_model(tmp_path / "draft", "qwen2", scale=0.15, noise=0.01), dtype="bfloat16",
                       quant="w4a8")
    spec = SpecConfig("draft", num_draft_tokens=2)
    fed = []  # tokens each of the draft model's prompt reads took in
    feed = DraftModelDrafter._feed
    monkeypatch.setattr(DraftModelDrafter, "_feed", lambda self, seq, cache, logits_at, upto: fed.append(
        upto - cache.lengths[0]) or feed(self, seq, cache, logits_at, upto))
    cached = Engine(target, draft, prefix_cache_bytes=2**24)
    first = cached.encode("abcabcabc abcabc")
    second = first + answered(cached, first, spec) + cached.encode(" abc", raw=True)
    fed.clear()
    hit = started(cached, second, GREEDY, spec)
    # one read, of less than the answer and the new turn: the draft's rows of the first turn's answer came back
    # too (all it had read: a draft model is a step behind the target when its request ends)
    assert len(fed) == 1 and fed[0] < len(second) - len(first) and hit.stats.cached_prompt_tokens > len(first)
    cold = started(Engine(target, draft), second, GREEDY, spec)
    hit_cache, cold_cache = hit.drafter_state["draft"], cold.drafter_state["draft"]
    assert hit_cache.lengths == cold_cache.lengths == [len(second)]
    assert torch.equal(hit_cache.keys[:, :, :, : len(second)], cold_cache.keys[:, :, :, : len(second)])
    assert torch.equal(hit_cache.values[:, :, :, : len(second)], cold_cache.values[:, :, :, : len(second)])


@pytest.mark.parametrize("budget", [-1, 1.5, "512"])
def test_a_budget_that_is_not_a_positive_byte_count_is_one_clear_error(budget):
    with pytest.raises(SpecDecodeError, match="prefix cache"):
        PrefixCache(budget)


def test_the_server_reuses_a_chats_earlier_turn_and_says_how_many_tokens_it_took(target):
    """Through the server: the second turn's usage names the cached tokens, its answer is what a server without
    a cache gives, a request with cache_prompt false reads its whole prompt, and /metrics shows the cache."""
    first = [{"role": "user", "content": "hello hello hello"}]
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    def chat(server, messages, **extra) -> tuple[str, int]:
        status, answer = server.post("/v1/chat/completions", {**body, **extra, "messages": messages})
        assert status == 200, answer
        return answer["choices"][0]["message"]["content"], answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    settings = replace(SETTINGS, spec=SpecConfig("ngram"))
    with running(create_app(Engine(target), settings)) as server:
        reply, cached = chat(server, first)
        assert cached == 0
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "and again"}]
        cold_answer = chat(server, second)
    with running(create_app(Engine(target, prefix_cache_bytes=2**24), settings)) as server:
        assert chat(server, first) == (reply, 0)
        answer, cached = chat(server, second)
        # at least the first turn's prompt (the tiny model's bytes are not UTF-8, so its reply's text does not
        # encode back to the same tokens; tests above reuse answers token for token)
        assert answer == cold_answer[0] and cached >= len(Engine(target).encode(first))
        assert chat(server, second, cache_prompt=False) == (cold_answer[0], 0)
        _, _, metrics = server.request("GET", "/metrics")
    lines = {line.split()[0]: float(line.split()[1]) for line in metrics.decode().splitlines()
             if line and not line.startswith("#")}
    assert lines["specdecode_prefix_cache_bytes"] > 0 and lines["specdecode_prefix_cache_entries"] >= 1
    assert lines["specdecode_prompt_tokens_cached_total"] == cached


@pytest.mark.parametrize(("text", "size"), [("512M", 512 * 2**20), ("1.5G", 3 * 2**29), ("off", 0), ("0", 0)])
def test_serve_reads_the_prefix_cache_budget_as_a_size_or_off(text, size):
    assert parse_size_or_off(text) == size
