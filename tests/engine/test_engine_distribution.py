"""End to end: sampled output of every drafting method follows the target's distribution.

verify.py's statistical tests check the acceptance rule alone; this runs the whole engine (drafters, caches,
rollback, the shared logits transform and the request's random generator) on a model with an 8-token
vocabulary, and compares the joint law of the first two generated tokens and the law of the third with the
exact one computed from the target's own logits.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from conftest import TickingClock, save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.acceptance.chi_square import chi_square
from specdecode.acceptance.sampling import logits_to_probs
from specdecode.models.kernels.w4a8_decoder import W4A8DecoderLayer
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model

VOCAB = 8
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so n-gram lookup drafts "3 1 2"
# 1500 seeded runs: about 23 draws in each of the 64 cells of the first two tokens' joint law, for errors that move
# whole cells (a wrong residual, a skipped rejection, a draft's q taken for the target's p); 2000 cost the suite two
# minutes more
RUNS = 1500
ALPHA = 1e-4  # a correct engine fails one run in 10,000
SETTINGS = {
    # A fourth token leaves room for two drafts after the first token, so chains and bonus tokens both occur.
    "temperature": SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
    "top-p": SamplingParams(temperature=0.8, top_p=0.8, max_tokens=4, ignore_eos=True),
}

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab8")
    target = load_model(save_tiny_model(root / "t", "qwen2", scale=0.6, vocab_size=VOCAB), dtype="float32")
    draft = load_model(save_tiny_model(root / "d", "qwen2", scale=0.6, noise=0.2, vocab_size=VOCAB),
                       dtype="float32")

    def w4a8_target():  # the same target in w4a8, its decoder layers fused in C++ (w4a8_layer.cpp)
        reason = w4a8_unavailable()
        if reason is not None:
            pytest.skip(f"w4a8 cannot run on this machine: {reason}")
        model = load_model(root / "t", dtype="float32", quant="w4a8")
        assert isinstance(model.model.layers[0], W4A8DecoderLayer)
        return model

    return {"float": lambda: target, "w4a8": w4a8_target}, draft


def exact_laws(model, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """-> joint p(t1, t2) [V, V] and marginal p(t3) [V], from the target's logits through the shared transform."""
    def next_probs(ids: list[int]) -> torch.Tensor:
        device = model.device
        with torch.inference_mode():
            logits = model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device).unsqueeze(0),
                           model.new_cache(len(ids))).logits[0, -1]  # [V]
        return logits_to_probs(logits, params).cpu()

    first = next_probs(PROMPT)  # [V]
    joint = torch.zeros(VOCAB, VOCAB)  # [V, V]
    third = torch.zeros(VOCAB)  # [V]
    for a, b in itertools.product(range(VOCAB), repeat=2):
        pair = first[a] * next_probs(PROMPT + [a])[b]
        joint[a, b] = pair
        if pair > 0:
            third += pair * next_probs(PROMPT + [a, b])
    return joint, third


def assert_follows_the_target(engine: Engine, params: SamplingParams, spec: SpecConfig) -> list:
    """RUNS seeded runs of PROMPT through `engine`: the first two tokens' joint and the third's marginal must pass
    chi-square against the target's own laws (exact_laws) -> every run's result."""
    joint, third = exact_laws(engine.target.model, params)
    pair_counts, third_counts = torch.zeros(VOCAB, VOCAB), torch.zeros(VOCAB)  # [V, V], [V]
    results = []
    for seed in range(RUNS):
        results.append(engine.complete(PROMPT, replace(params, seed=seed), spec))
        a, b, c = results[-1].token_ids[:3]
        pair_counts[a, b] += 1
        third_counts[c] += 1
    assert chi_square_passes(pair_counts, joint)
    assert chi_square_passes(third_counts, third)
    return results


def chi_square_passes(counts: torch.Tensor, probs: torch.Tensor) -> bool:
    """Pearson's test at ALPHA, cells expecting fewer than 5 draws pooled into one (the usual rule)."""
    test = chi_square(counts, probs, ALPHA)
    assert test.impossible == 0, "a token the target never produces was emitted"
    return test.passed


# A drafter alone at temperature 1 is the drafter contract's (tests/drafters/test_drafter_contract.py, the same
# engine settings and laws); here: plain sampling, top-p, a w4a8 target, combinations and the per-step choice.
@pytest.mark.parametrize(("method", "setting", "target_kind", "rule"), [
    ("none", "temperature", "float", "block"), ("draft", "top-p", "float", "block"),
    ("ngram,draft", "top-p", "float", "block"), ("ngram,draft", "temperature", "w4a8", "block"),
    # Per-step choice between a lookup and a sampling drafter: the choice must not skew the law.
    ("ngram,draft:best", "temperature", "float", "block"),
    # Coupled: plain decoding's Gumbel-max draws follow the target (every method's output equals them at a seed:
    # test_drafter_contract.py), and so do a sampling drafter's and a lookup's, chosen per step.
    ("none", "top-p", "float", "coupled"), ("ngram,draft:best", "temperature", "float", "coupled"),
])
def test_sampled_tokens_follow_the_target_distribution(small_vocab_pair, setting, method, target_kind, rule):
    targets, draft = small_vocab_pair
    target = targets[target_kind]()
    engine = Engine(target, draft)
    params = SETTINGS[setting]
    # The guard is not under test here, and per-step choice reads a clock that ticks per read: what is drafted
    # depends on the seed alone, never on the machine's load.
    spec = SpecConfig(method.removesuffix(":best"), num_draft_tokens=2, adaptive=False, guard=False,
                      combine="best" if method.endswith(":best") else "first", verification=rule)
    if method.endswith(":best"):
        engine.drafter(spec).clock = TickingClock()
    results = assert_follows_the_target(engine, params, spec)
    drafted = sum(result.stats.drafted_tokens for result in results)
    sources = {method for result in results for method in result.stats.drafted_by}
    # Speculation really ran (n-gram drafts only on a match; per-step choice may also leave a step plain when no
    # member promises more, which on these tiny models, a draft as costly as the target, it often does).
    assert method == "none" or drafted > (RUNS // 4 if method.endswith(":best") else RUNS // 2)
    if method.endswith(":best"):
        assert sources == {"ngram", "draft"}  # the choice went both ways
