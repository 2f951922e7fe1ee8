"""logits_to_probs against a slow per-row reference, and sample()'s shapes and determinism."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.acceptance.sampling import logits_to_probs, sample
from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError


def _reference_probs(row: list[float], params: SamplingParams) -> list[float]:
    """One row, plain Python floats, the definitions spelled out one filter at a time."""
    vocab = range(len(row))
    if params.greedy:
        best = max(vocab, key=lambda i: (row[i], -i))  # ties -> lowest index
        return [1.0 if i == best else 0.0 for i in vocab]
    scaled = [x / params.temperature for x in row]
    kept = [True] * len(row)

    def probs_of_kept() -> list[float]:
        top = max(scaled[i] for i in vocab if kept[i])
        weights = [math.exp(scaled[i] - top) if kept[i] else 0.0 for i in vocab]
        total = sum(weights)
        return [w / total for w in weights]

    if 0 < params.top_k < len(row):
        kth = sorted(scaled, reverse=True)[params.top_k - 1]
        kept = [kept[i] and scaled[i] >= kth for i in vocab]
    if params.top_p < 1:
        probs = probs_of_kept()
        mass = 0.0
        for i in sorted(vocab, key=lambda i: (-probs[i], i)):
            if kept[i] and mass >= params.top_p:  # the set already reached top_p: drop the rest
                kept[i] = False
            mass += probs[i]
    if params.min_p > 0:
        probs = probs_of_kept()
        kept = [kept[i] and probs[i] >= params.min_p * max(probs) for i in vocab]
    return probs_of_kept()


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.3),
    SamplingParams(temperature=2.5),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.0, top_k=50),  # >= V: off
    SamplingParams(temperature=1.0, top_p=0.05),  # only the top token reaches it
    SamplingParams(temperature=1.0, top_p=0.5),
    SamplingParams(temperature=1.5, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.8, min_p=0.3),
    SamplingParams(temperature=1.2, top_k=6, top_p=0.8),
    SamplingParams(temperature=1.3, top_p=0.95, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", SETTINGS, ids=repr)
def test_logits_to_probs_matches_reference(params: SamplingParams) -> None:
    logits = 2.0 * torch.randn(8, 11, generator=torch.Generator().manual_seed(0))  # [R, V]
    probs = logits_to_probs(logits, params)  # [R, V]
    assert probs.dtype == torch.float32 and probs.shape == logits.shape
    for row, got in zip(logits.tolist(), probs.tolist()):
        want = _reference_probs(row, params)
        assert [g > 0 for g in got] == [w > 0 for w in want], "different set of surviving tokens"
        assert got == pytest.approx(want, abs=1e-6)
    torch.testing.assert_close(probs.sum(-1), torch.ones(8))


def test_filters_cut_where_defined() -> None:
    logits = torch.tensor([0.5, 0.3, 0.2]).log()  # [V]

    def kept(**filters: float) -> list[bool]:
        return (logits_to_probs(logits, SamplingParams(temperature=1.0, **filters)) > 0).tolist()

    assert kept(top_p=0.45) == [True, False, False]
    assert kept(top_p=0.6) == [True, True, False]  # 0.5 < 0.6 <= 0.8: smallest set reaching top_p
    assert kept(top_p=0.85) == [True, True, True]
    assert kept(min_p=0.5) == [True, True, False]  # 0.2 < 0.5 * 0.5
    assert kept(top_k=2) == [True, True, False]


def test_top_k_keeps_ties_at_the_boundary() -> None:
    # As transformers' TopKLogitsWarper: a threshold on the k-th value, so equal logits share the fate.
    probs = logits_to_probs(torch.tensor([1.0, 3.0, 3.0, 0.0]), SamplingParams(temperature=1.0, top_k=1))  # [V]
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.5, 0.5, 0.0]))


def test_greedy_is_one_hot_of_argmax_with_lowest_index_on_ties() -> None:
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, 1.0, 5.0, 5.0]])  # [R, V]
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))  # [R, V]
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("shape", [(7,), (3, 7), (2, 3, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shapes_and_dtypes(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)  # [..., V]
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.05)
    probs = logits_to_probs(logits, params)  # [..., V]
    assert probs.shape == shape and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(shape[:-1]))
    # Rows are independent: the batched result equals row-by-row.
    flat = logits.reshape(-1, shape[-1])  # [R, V]
    torch.testing.assert_close(probs.reshape(-1, shape[-1]), torch.stack([logits_to_probs(r, params) for r in flat]))
    ids = sample(probs, torch.Generator().manual_seed(0))  # [...]
    assert ids.shape == shape[:-1] and ids.dtype == torch.long


def test_sample_same_seed_same_output() -> None:
    probs = torch.rand(50, 9, generator=torch.Generator().manual_seed(2))  # [R, V], unnormalised on purpose
    first = sample(probs, torch.Generator().manual_seed(5))  # [R]
    second = sample(probs, torch.Generator().manual_seed(5))  # [R]
    assert torch.equal(first, second)
    assert not torch.equal(first, sample(probs, torch.Generator().manual_seed(6)))


def test_sample_never_draws_zero_probability_and_follows_probs() -> None:
    probs = torch.tensor([0.0, 0.6, 0.0, 0.3, 0.1])  # [V]
    ids = sample(probs.expand(20_000, -1), torch.Generator().manual_seed(3))  # [N]
    freq = torch.bincount(ids, minlength=5).double() / ids.numel()  # [V]
    assert freq[0] == 0 and freq[2] == 0
    # 20k draws: the standard error of each frequency is <= 0.0035, so 0.015 is over 4 sigma.
    assert (freq - probs.double()).abs().max() < 0.015
    assert int(sample(torch.tensor([0.0, 0.0, 1.0]), None)) == 2  # None: the global generator


@pytest.mark.parametrize("top_p", [5e-324, 1e-50, 1e-46])
def test_top_p_that_rounds_to_zero_in_float32_keeps_the_top_token(top_p: float) -> None:
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(4))  # [R, V]
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))  # [R, V]
    torch.testing.assert_close(probs, logits_to_probs(logits, SamplingParams(temperature=0.0)))
    assert torch.equal(sample(probs, torch.Generator().manual_seed(0)), logits.argmax(-1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_sampling_a_broken_distribution_is_one_clear_error(bad: float) -> None:
    probs = torch.tensor([0.2, bad, 0.3])  # [V], as NaN or inf logits from corrupt weights would give
    with pytest.raises(SpecDecodeError, match="NaN, inf or negative"):
        sample(probs, torch.Generator().manual_seed(0))
