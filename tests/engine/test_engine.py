"""The heart of the suite: every drafting method reproduces plain decoding exactly, and stats add up."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models.loader import load_model

# Prompts with repetition so prompt lookup finds matches, and one without.
PROMPTS = ["hello hello hello", "abcabcabc abcabc", "The quick brown fox", "1 2 3 1 2 3 1 2"]
METHODS = ["ngram", "draft", "ngram,draft"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pair(noisy_pair):
    return noisy_pair


@pytest.fixture(scope="module")
def engine(pair):
    return Engine(*pair)


@pytest.fixture(scope="module")
def plain_outputs(engine):
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    return {p: engine.complete(p, sampling, SpecConfig("none")).token_ids for p in PROMPTS}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_output_equals_plain_decoding(engine, plain_outputs, method, k, adaptive):
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = engine.complete(prompt, sampling, SpecConfig(method, num_draft_tokens=k, adaptive=adaptive))
        assert result.token_ids == plain_outputs[prompt], f"{method} k={k} diverged on {prompt!r}"
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    # The check only has teeth if drafts were both accepted and rejected (so rollback ran).
    assert 0 < accepted < drafted


def test_draft_in_cheaper_dtype_keeps_output(pair, plain_outputs, tmp_path):
    target, _ = pair
    draft_bf16 = load_model(save_tiny_model(tmp_path / "d", "qwen2", scale=0.15, noise=0.01), dtype="bfloat16")
    engine = Engine(target, draft_bf16)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt in PROMPTS:
        assert engine.complete(prompt, sampling, SpecConfig("draft")).token_ids == plain_outputs[prompt]


@pytest.mark.parametrize("method", ["none", *METHODS])
def test_same_seed_same_sampled_text(engine, method):
    # The speed guard decides from wall-clock timings which steps draft, and with sampling that decides which
    # random draws make each token (README): a seed reproduces the text with the guard off, as documented.
    spec = SpecConfig(method, guard=False)
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, max_tokens=30, seed=7, ignore_eos=True)
    first = engine.complete(PROMPTS[0], sampling, spec)
    second = engine.complete(PROMPTS[0], sampling, spec)
    assert first.token_ids == second.token_ids and len(first.token_ids) == 30
    other = engine.complete(PROMPTS[0], SamplingParams(temperature=0.9, max_tokens=30, seed=8, ignore_eos=True),
                            spec)
    assert other.token_ids != first.token_ids


def test_stats_add_up(engine):
    result = engine.complete(PROMPTS[3], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                             SpecConfig("ngram,draft"))
    stats = result.stats
    assert stats.new_tokens == len(result.token_ids) == MAX_TOKENS
    assert stats.new_tokens == 1 + stats.step_tokens  # the first token comes from prefill
    assert stats.accepted_tokens <= stats.drafted_tokens
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert sum(stats.drafted_by.values()) == stats.drafted_tokens
    # A draft position is only reached when every earlier one was drafted.
    assert all(a >= b for a, b in zip(stats.drafted_per_position, stats.drafted_per_position[1:]))
    assert stats.mean_accepted_length == pytest.approx(stats.step_tokens / stats.target_forwards)
    plain = engine.complete(PROMPTS[3], SamplingParams(max_tokens=10, ignore_eos=True), SpecConfig("none"))
    assert plain.stats.mean_accepted_length == 1.0 and plain.stats.drafted_tokens == 0


def test_streamed_text_matches_decoded_ids(engine):
    events = list(engine.generate(PROMPTS[1], SamplingParams(max_tokens=25, ignore_eos=True),
                                  SpecConfig("ngram")))
    ids = [t for e in events for t in e.token_ids]
    assert "".join(e.text for e in events) == engine.target.tokenizer.decode(ids)
    assert [e.finish_reason for e in events][-1] == "length"
    assert all(e.stats is None for e in events[:-1]) and events[-1].stats is not None


def test_stops_at_end_of_turn_token(engine, plain_outputs):
    eos_token = plain_outputs[PROMPTS[2]][5]
    engine.target.tokenizer.eos_token_ids = frozenset({eos_token})
    try:
        result = engine.complete(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS), SpecConfig("draft"))
    finally:
        engine.target.tokenizer.eos_token_ids = frozenset({256, 257})
    assert result.finish_reason == "stop"
    assert result.token_ids == plain_outputs[PROMPTS[2]][: plain_outputs[PROMPTS[2]].index(eos_token) + 1]


def test_stop_string_cuts_text_and_ids_where_plain_decoding_does(engine, plain_outputs):
    full = engine.target.tokenizer.decode(plain_outputs[PROMPTS[0]])
    stop = full[10:13]
    sampling = SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,), ignore_eos=True)
    plain = engine.complete(PROMPTS[0], sampling, SpecConfig("none"))
    assert plain.finish_reason == "stop" and plain.text == full[: full.index(stop)]
    for method in METHODS:
        result = engine.complete(PROMPTS[0], sampling, SpecConfig(method, num_draft_tokens=8))
        assert (result.text, result.token_ids, result.finish_reason) == (plain.text, plain.token_ids, "stop")
        assert result.stats.new_tokens == len(plain.token_ids)


def test_context_limit_ends_generation(pair):
    engine = Engine(*pair, context_limit=40)
    prompt_len = len(engine.encode(PROMPTS[0]))
    result = engine.complete(PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True), SpecConfig("ngram,draft"))
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 40 - prompt_len


def test_prompt_over_context_is_a_clear_error(pair):
    engine = Engine(*pair, context_limit=10)
    with pytest.raises(SpecDecodeError, match="leaves no room in the context of 10"):
        engine.complete("a much longer prompt than ten tokens")


def test_unknown_method_lists_valid_ones(engine):
    with pytest.raises(SpecDecodeError, match="unknown speculative method 'eagle9'.*draft.*ngram.*none"):
        engine.complete("hi", spec=SpecConfig("eagle9"))


def test_draft_method_without_draft_model(pair):
    with pytest.raises(SpecDecodeError, match="needs a draft model"):
        Engine(pair[0], spec=SpecConfig("ngram,draft"))


@pytest.mark.parametrize("k", [-1, 65, 10_000])
def test_absurd_draft_lengths_are_rejected(k):
    with pytest.raises(SpecDecodeError, match="num_draft_tokens must be between 0 and 64"):
        SpecConfig("ngram", num_draft_tokens=k)


def test_vocabulary_mismatch_names_both_models(pair, tmp_path):
    target, _ = pair
    folder = save_tiny_model(tmp_path / "other", "qwen2", scale=0.15)
    other = load_model(folder, dtype="float32")
    other.tokenizer.hf.add_tokens(["<extra_token>"])
    # Checked when a method drafts with the draft model (the draft-model drafter owns the check).
    with pytest.raises(SpecDecodeError, match=r"vocabulary mismatch: draft model .*other.* and target"):
        Engine(target, other, SpecConfig("ngram,draft"))


def test_larger_draft_warns(pair, tmp_path, caplog):
    target, _ = pair
    bigger = load_model(save_tiny_model(tmp_path / "big", "qwen2", scale=0.15, num_hidden_layers=6), dtype="float32")
    with caplog.at_level("WARNING"):
        Engine(target, bigger, SpecConfig("draft"))
    assert "is not smaller than the target" in caplog.text


def test_zero_draft_tokens_is_plain_decoding(engine, plain_outputs):
    result = engine.complete(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                             SpecConfig("ngram,draft", num_draft_tokens=0))
    assert result.token_ids == plain_outputs[PROMPTS[0]]
    assert result.stats.drafted_tokens == 0 and result.stats.mean_accepted_length == 1.0


def test_draft_p_min_stops_unsure_drafts(engine, plain_outputs):
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    loose = engine.complete(PROMPTS[2], sampling, SpecConfig("draft", num_draft_tokens=8, adaptive=False))
    strict = engine.complete(PROMPTS[2], sampling, SpecConfig("draft", num_draft_tokens=8, adaptive=False,
                                                              draft_p_min=0.9))
    assert strict.token_ids == loose.token_ids == plain_outputs[PROMPTS[2]]
    assert strict.stats.drafted_tokens < loose.stats.drafted_tokens


def test_inference_mode_does_not_leak_between_events(engine):
    for _ in engine.generate(PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True), SpecConfig("draft")):
        assert not torch.is_inference_mode_enabled()


def test_drafters_are_created_once_and_their_number_is_bounded(pair, monkeypatch):
    """Past the bound the least recently used configuration goes, never the default: no client's new options can
    lock the others out."""
    import specdecode.engine.engine

    engine = Engine(*pair, spec=SpecConfig("ngram"))
    default = engine.drafter(engine.spec)
    assert engine.drafter(SpecConfig("ngram,draft")).members[1] is engine.drafter(SpecConfig("draft"))
    monkeypatch.setattr(specdecode.engine.engine, "MAX_DRAFTER_CONFIGS", 4)  # "ngram", "ngram,draft", "draft" so far
    engine.drafter(SpecConfig("ngram", ngram_max=2))
    combined = engine.drafter(SpecConfig("ngram,draft"))  # known: no new drafter, and now the most recent
    for depth in range(1, 20):  # one client's stream of new configurations
        engine.drafter(SpecConfig("suffix", suffix_max_depth=depth))
    assert len(engine._drafters) == 4 and engine.drafter(engine.spec) is default
    assert engine.drafter(SpecConfig("ngram,draft")) is not combined  # evicted on the way, built again
    assert len(engine._members) <= 5  # members no kept configuration uses went with them
    engine.check_spec(SpecConfig("ngram", ngram_max=4))  # a check builds nothing, so it never hits the bound


def test_memory_in_stats_is_sized_to_the_request(engine):
    """The target's KV cache holds prompt + max_tokens (+ a step's drafts), not the model's whole context."""
    prompt = "hello hello hello"
    sizes = {}
    for max_tokens in (8, 72):
        result = engine.complete(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), SpecConfig("draft"))
        sizes[max_tokens] = result.stats
    config = engine.target.config
    per_slot = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4 + 8  # fp32 keys, values; position
    slots = {n: s.kv_cache_bytes / per_slot for n, s in sizes.items()}
    assert slots[72] - slots[8] == 64  # exactly the extra tokens asked for
    assert slots[72] < engine.context_limit / 2
    assert sizes[8].drafter_request_bytes > 0 and sizes[8].to_dict()["kv_cache_bytes"] == sizes[8].kv_cache_bytes
    lookup = engine.complete(prompt, SamplingParams(max_tokens=8, ignore_eos=True), SpecConfig("ngram")).stats
    assert lookup.drafter_request_bytes == 0 and lookup.kv_cache_bytes > 0


def test_the_last_event_carries_the_request_end_stats(engine):
    """A server reads the last event's stats before it closes the generator (and before finish runs)."""
    events = engine.generate("hello hello hello", SamplingParams(max_tokens=8, ignore_eos=True), SpecConfig("draft"))
    last = next(event for event in events if event.finish_reason is not None)  # the generator is not closed yet
    assert last.stats.kv_cache_bytes > 0 and last.stats.drafter_request_bytes > 0
    events.close()


def test_the_prefill_phase_reports_the_drafters_share(pair):
    """A draft model prefills the prompt in the prefill phase (not in its first proposal), and the stats say how
    long that took within the phase."""
    target, draft = pair
    result = Engine(target, draft).complete("hello hello", SamplingParams(max_tokens=4), SpecConfig("draft"))
    stats = result.stats
    assert 0 < stats.drafter_prefill_seconds < stats.prefill_seconds
    assert stats.to_dict()["drafter_prefill_seconds"] == round(stats.drafter_prefill_seconds, 4)
