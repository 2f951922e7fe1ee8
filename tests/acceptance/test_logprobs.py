"""Log-probabilities of emitted tokens: the target's raw numbers, the same from every drafting method as from
plain decoding (bitwise on a w4a8 target), one per emitted token whatever cuts the output."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model

PROMPTS = ["hello hello hello", "abcabcabc abcabc", [1, 2, 3, 1, 2, 3, 1, 2]]
# Every drafter, chains and trees: each verifies a different number of rows per forward.
SPECS = [SpecConfig("ngram"), SpecConfig("draft", num_draft_tokens=4), SpecConfig("ngram,draft"),
         SpecConfig("draft", draft_tree_nodes=8), SpecConfig("ngram", ngram_branches=3)]
GREEDY = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    return save_tiny_model(root / "target", "qwen2", scale=0.15), save_tiny_model(root / "draft", "qwen2", scale=0.15,
                                                                                  noise=0.01)


@pytest.fixture(scope="module")
def engine(folders):
    return Engine(*(load_model(folder, dtype="float32") for folder in folders))


def reference_logprobs(engine: Engine, prompt, token_ids: list[int]) -> torch.Tensor:
    """The target's log_softmax at every emitted token, from one forward over prompt + output: [T, V]."""
    ids = engine.encode(prompt, raw=isinstance(prompt, str)) + token_ids
    model = engine.target.model
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), model.new_cache(len(ids))).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)[len(ids) - len(token_ids) - 1 : -1]  # [T, V]


@pytest.mark.parametrize("prompt", PROMPTS, ids=repr)
def test_plain_decoding_reports_the_targets_raw_log_probabilities(engine, prompt):
    result = engine.complete(prompt, GREEDY, SpecConfig("none"), raw=isinstance(prompt, str))
    assert [entry.token_id for entry in result.logprobs] == result.token_ids
    reference = reference_logprobs(engine, prompt, result.token_ids)  # [T, V]
    for entry, row in zip(result.logprobs, reference):
        assert entry.logprob == pytest.approx(float(row[entry.token_id]), abs=1e-4)
        top_values, top_ids = row.topk(5)
        assert [token for token, _ in entry.top] == top_ids.tolist()
        assert [value for _, value in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)
        assert entry.top[0][0] == entry.token_id  # greedy: the chosen token is the most likely


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.method}{dict(s.options)}")
def test_every_method_gives_the_numbers_of_plain_decoding(engine, spec):
    drafted = 0
    for prompt in PROMPTS:
        plain = engine.complete(prompt, GREEDY, SpecConfig("none"), raw=isinstance(prompt, str))
        speculative = engine.complete(prompt, GREEDY, spec, raw=isinstance(prompt, str))
        assert speculative.token_ids == plain.token_ids
        assert [e.token_id for e in speculative.logprobs] == speculative.token_ids
        for ours, theirs in zip(speculative.logprobs, plain.logprobs, strict=True):
            # fp32 verifies several rows in one matmul, which may round the last bit differently than one row.
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-5)
            assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
            assert [v for _, v in ours.top] == pytest.approx([v for _, v in theirs.top], abs=1e-5)
        drafted += speculative.stats.accepted_tokens
    assert drafted > 0  # the numbers came from multi-row verify forwards, not only from single rows


def test_w4a8_target_gives_bitwise_the_numbers_of_plain_decoding(folders):
    reason = w4a8_unavailable()
    if reason is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {reason}")
    target = load_model(folders[0], dtype="bfloat16", quant="w4a8")
    engine = Engine(target, load_model(folders[1], dtype="float32"))
    for prompt in PROMPTS:
        plain = engine.complete(prompt, GREEDY, SpecConfig("none"), raw=isinstance(prompt, str))
        for spec in SPECS:
            speculative = engine.complete(prompt, GREEDY, spec, raw=isinstance(prompt, str))
            assert speculative.logprobs == plain.logprobs, spec  # dataclass equality: every float bit for bit


def test_one_entry_per_emitted_token_through_stops_and_events(engine):
    full = engine.complete("abcabcabc", GREEDY, SpecConfig("ngram,draft"), raw=True)
    stop = next(ch for ch in full.text[1:] if ch.isascii() and ch.isprintable())
    sampling = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=0, stop=(stop,))
    events = list(engine.generate("abcabcabc", sampling, SpecConfig("ngram,draft"), raw=True))
    assert all(len(e.logprobs) == len(e.token_ids) for e in events) and events[-1].finish_reason == "stop"
    entries = [entry for event in events for entry in event.logprobs]
    assert [e.token_id for e in entries] == [t for event in events for t in event.token_ids]
    assert all(e.top == () for e in entries)
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in full.logprobs[: len(entries)]],
                                                         abs=1e-5)


def test_sampled_tokens_get_raw_log_probabilities_and_none_when_not_asked(engine):
    sampled = engine.complete("hello", SamplingParams(temperature=0.7, top_k=1, max_tokens=12, seed=1, logprobs=20,
                                                      ignore_eos=True), SpecConfig("ngram,draft"), raw=True)
    for entry in sampled.logprobs:
        assert len(entry.top) == 20 and [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        # top_k=1 samples the argmax; its raw log-probability is below 0, not the filtered distribution's 0.
        assert entry.top[0] == (entry.token_id, entry.logprob) and entry.logprob < 0
    assert engine.complete("hello", SamplingParams(max_tokens=4), raw=True).logprobs is None
