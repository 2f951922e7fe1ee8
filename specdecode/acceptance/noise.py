"""Coupled noise: the randomness of sampling keyed by (seed, position), so that a token's draw depends on nothing else.

Gumbel-max: x = argmax_i (log p_i + g_i), with g_i i.i.d. Gumbel(0, 1), is an exact sample from p. Written as an
exponential race (g_i = -log E_i, E_i ~ Exp(1)) it is x = argmax_i p_i w_i with w_i = 1 / E_i, which needs no log
of p and no normalisation; tokens the shared transform removed (p_i = 0) never win. We keep the race weights w.

Counter-based: the weights of one position are a fixed function of (seed, position, token id). The row of
(seed, position) is the first V outputs of SplitMix64 (Steele, Lea and Flood 2014) started from
key = mix(mix(seed) ^ position): word i is mix(key + (i + 1) γ), whose top 53 bits give v uniform in (0, 1), and
E_i = -log(1 - v). Nothing is drawn from a stream, so the noise cannot depend on the batch a request shares, the
length or shape of a draft, the order requests arrive in, or the thread count (the integer words are exact, and the
float transform is elementwise: tests/acceptance/test_noise.py checks it bitwise under several thread counts).

Why it matters: the target's token at a position is argmax p w there given the accepted prefix, whatever was drafted
(acceptance/verify.py's coupled rule), so a seeded answer is plain decoding's at that seed, token for token. A
drafter that samples draws argmax q w with the same row, agreeing with the target as often as q allows: with a
probability between (1 - TV) / (1 + TV) and 1 - TV (Daliri, Musco and Suresh 2024 study this coupling for
drafter-invariant speculative decoding).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from specdecode.acceptance.tree import depths
from specdecode.spec_types import DraftProposal

_MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment
_MIX = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # its output function's multipliers (Stafford's Mix13)
_SHIFTS = (30, 27, 31)
_SEED_SALT = 0x5EED5EED5EED5EED  # so that seed 0 and position 0 do not start from mix(0) = 0
_LARGEST_BELOW_ONE = 1.0 - 2.0**-24  # in float32: v = 1 would make E infinite and the token unable to win


def _signed(value: int) -> int:
    """A 64-bit word as torch's int64 holds it (two's complement)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


def mix64(value: int) -> int:
    """SplitMix64's output function on one word (a bijection of 64-bit words), in Python integers."""
    value &= _MASK64
    for shift, multiplier in zip(_SHIFTS, (*_MIX, None)):
        value ^= value >> shift
        if multiplier is not None:
            value = (value * multiplier) & _MASK64
    return value


def position_key(seed: int, position: int) -> int:
    """The key of one position's row (int64 as torch holds it): distinct positions of a seed get distinct keys."""
    return _signed(mix64(mix64(seed ^ _SEED_SALT) ^ position))


@lru_cache(maxsize=8)
def _counters(vocab: int, device: torch.device) -> torch.Tensor:
    """[V] int64: (i + 1) γ for every token id i, wrapped to 64 bits (a row adds its key)."""
    return torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(GOLDEN_GAMMA)


def race_weights(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """keys [R] int64 (position_key) -> w [R, V] float32, w = 1 / E with E ~ Exp(1) i.i.d. per token.

    torch's int64 arithmetic wraps modulo 2^64, as SplitMix64's does; its right shift is arithmetic, so each shift
    is masked to the logical one. Written in place: this runs once per generated token over the whole vocabulary
    (151,936 ids for Qwen: 0.8 ms on one core, against 3.2 ms for torch.multinomial over the same row;
    docs/benchmarks/coupled_noise_cost.py)."""
    words = keys[:, None] + _counters(vocab, keys.device)  # [R, V] int64: key + (i + 1) γ
    shifted = torch.empty_like(words)  # [R, V] int64
    for shift, multiplier in zip(_SHIFTS, (*_MIX, None)):
        torch.bitwise_right_shift(words, shift, out=shifted)
        shifted &= (1 << (64 - shift)) - 1
        words ^= shifted
        if multiplier is not None:
            words *= _signed(multiplier)
    words >>= 11
    words &= (1 << 53) - 1  # [R, V]: the top 53 bits of each word
    # v = (k + 1/2) 2^-53 in (0, 1): converted from the integer, a small v keeps its relative precision, so the
    # largest weights (small E), which decide the race, are as fine as float32 allows.
    uniform = words.to(torch.float32).add_(0.5).mul_(2.0**-53).clamp_(max=_LARGEST_BELOW_ONE)  # [R, V]
    return uniform.neg_().log1p_().neg_().reciprocal_()  # [R, V]: 1 / E, E = -log(1 - v)


def coupled_tokens(probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """probs [..., V] (the shared transform's law, zeros outside its kept set), weights [..., V] -> the Gumbel-max
    tokens [...] long (ties -> the lowest id)."""
    return (probs * weights.to(probs.device)).argmax(dim=-1)


class PositionNoise:
    """One request's race weights by absolute position (the index in its tokens that the sampled token takes).

    A row is computed once while its position is pending: a step's drafter and its verification read the same row,
    and the positions a step drafted past its accepted tokens come back in the next step. Rows below the lowest
    position asked for are dropped (positions only move forward)."""

    def __init__(self, seed: int, vocab: int, device: torch.device | str):
        self.seed = seed
        self.vocab = vocab
        self.device = torch.device(device)
        self._rows: dict[int, torch.Tensor] = {}  # position -> its weights [V]

    def rows(self, positions: list[int]) -> torch.Tensor:
        """-> weights [R, V] for `positions` (repeats allowed: a tree's siblings share a position)."""
        missing = sorted({p for p in positions if p not in self._rows})
        if missing:
            keys = torch.tensor([position_key(self.seed, p) for p in missing], device=self.device)  # [M]
            for position, row in zip(missing, race_weights(keys, self.vocab)):
                self._rows[position] = row
        lowest = min(positions)
        for position in [p for p in self._rows if p < lowest]:
            del self._rows[position]
        return torch.stack([self._rows[p] for p in positions])  # [R, V]

    def for_proposal(self, proposal: DraftProposal, position: int) -> torch.Tensor:
        """-> weights [N+1, V] for the rows of a verify forward: row 0 (the root) samples `position`, a node at depth
        d samples position + d."""
        return self.rows([position] + [position + depth for depth in depths(proposal.parent_list())])
