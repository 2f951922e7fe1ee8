"""Pearson's chi-square goodness-of-fit test, as `check` and the distribution tests apply it to emitted tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import torch

MIN_EXPECTED = 5.0  # cells expecting fewer draws are pooled into one, as the chi-square approximation needs


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    critical: float  # the statistic's 1 - alpha quantile under the hypothesis
    degrees_of_freedom: int
    impossible: int  # draws in cells the law gives probability 0 (any one rejects the law)

    @property
    def passed(self) -> bool:
        return self.impossible == 0 and self.statistic < self.critical


def chi_square(counts: torch.Tensor, probs: torch.Tensor, alpha: float) -> ChiSquare:
    """counts [...] of draws against probs [...] (the law they should follow; summing to 1)."""
    counts, probs = counts.flatten().double(), probs.flatten().double()  # [C] each
    expected = probs / probs.sum() * counts.sum()  # [C]
    impossible = int(counts[expected == 0].sum())
    big = expected >= MIN_EXPECTED
    observed = torch.cat([counts[big], counts[~big & (expected > 0)].sum().reshape(1)])
    wanted = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = wanted > 0
    statistic = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    df = max(int(keep.sum()) - 1, 1)
    return ChiSquare(statistic, chi_square_quantile(df, 1 - alpha), df, impossible)


def chi_square_quantile(df: int, q: float) -> float:
    """Wilson-Hilferty's approximation of the chi-square quantile (within 2% from a few degrees of freedom)."""
    c = 2 / (9 * df)
    return df * (1 - c + NormalDist().inv_cdf(q) * math.sqrt(c)) ** 3
