"""Coupled noise (acceptance/noise.py): SplitMix64 words computed exactly, a row that depends on (seed, position)
alone (not on the rows computed with it, their order or the thread count), and a Gumbel-max race whose winners
follow p."""

from __future__ import annotations

import pytest
import torch

from specdecode.acceptance.chi_square import chi_square
from specdecode.acceptance.noise import GOLDEN_GAMMA, PositionNoise, coupled_tokens, mix64, position_key, race_weights
from specdecode.spec_types import DraftProposal

VOCAB = 1000


def splitmix64_outputs(seed: int, count: int) -> list[int]:
    """The reference generator, stepwise as Steele et al. write it: state += γ; output mix(state)."""
    state, outputs = seed, []
    for _ in range(count):
        state = (state + GOLDEN_GAMMA) & (2**64 - 1)
        outputs.append(mix64(state))
    return outputs


def test_mix64_is_splitmix64s_output_function():
    # SplitMix64 seeded with 0: the first outputs every implementation agrees on (e.g. Vigna's splitmix64.c).
    assert splitmix64_outputs(0, 4) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F,
                                        0xF88BB8A8724C81EC]


def test_a_row_is_the_splitmix64_stream_of_its_key_mapped_to_race_weights():
    key = position_key(seed=12345, position=77)
    words = splitmix64_outputs(key & (2**64 - 1), VOCAB)
    tops = torch.tensor([word >> 11 for word in words], dtype=torch.int64)  # [V] the 53 bits a weight uses
    uniform = tops.to(torch.float32).add_(0.5).mul_(2.0**-53).clamp_(max=1 - 2**-24)  # [V]
    expected = 1 / -torch.log1p(-uniform)  # [V]
    assert torch.equal(race_weights(torch.tensor([key]), VOCAB)[0], expected)


def test_a_row_depends_on_its_seed_and_position_alone():
    noise = PositionNoise(seed=5, vocab=VOCAB, device="cpu")
    together = noise.rows([3, 4, 9])  # [3, V]
    alone = [PositionNoise(5, VOCAB, "cpu").rows([p])[0] for p in (9, 4, 3)]  # other order, one at a time
    assert all(torch.equal(together[i], row) for i, row in zip((2, 1, 0), alone))
    assert torch.equal(PositionNoise(5, VOCAB, "cpu").rows([4, 4])[1], together[1])  # siblings share a row
    other_seed, other_position = PositionNoise(6, VOCAB, "cpu").rows([3])[0], together[1]
    assert not torch.equal(together[0], other_seed) and not torch.equal(together[0], other_position)


def test_a_row_is_bitwise_the_same_under_any_thread_count():
    keys = torch.tensor([position_key(7, p) for p in range(4)])  # [4]
    threads = torch.get_num_threads()
    try:
        rows = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            rows.append(race_weights(keys, 151_936))  # the default vocabulary: large enough to run in parallel
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])


def test_rows_are_kept_while_pending_and_dropped_after():
    noise = PositionNoise(seed=1, vocab=VOCAB, device="cpu")
    first = noise.rows([10, 11, 12])
    assert sorted(noise._rows) == [10, 11, 12]
    tree = DraftProposal(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]))  # depths 1, 1, 2
    rows = noise.for_proposal(tree, 11)  # the root samples 11, the nodes 12, 12, 13
    assert torch.equal(rows[1], first[2]) and torch.equal(rows[2], first[2]) and torch.equal(rows[0], first[1])
    assert sorted(noise._rows) == [11, 12, 13]


@pytest.mark.parametrize("probs", [[0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0],
                                   [0.9, 0.05, 0.03, 0.01, 0.01, 0.0]], ids=["spread", "peaked"])
def test_the_race_draws_from_p(probs):
    """Gumbel-max over the rows of 20,000 positions: each token wins as often as p says (chi-square, alpha 1e-4),
    and a token p rules out never wins."""
    p = torch.tensor(probs)  # [6]
    noise = PositionNoise(seed=2, vocab=p.numel(), device="cpu")
    winners = coupled_tokens(p, noise.rows(list(range(20_000))))  # [20000]
    test = chi_square(torch.bincount(winners, minlength=p.numel()).double(), p.double(), 1e-4)
    assert test.impossible == 0 and test.passed
