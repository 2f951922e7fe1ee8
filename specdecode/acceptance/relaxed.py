"""Relaxed acceptance: opt-in rules that keep more drafts than the exact rule does, at the price of output that
is no longer the target's own. Off unless named; labelled lossy in stats, the server's `speculative` object
and bench reports; `specdecode check` calls such a configuration not lossless.

Two published rules, each applied to a drafted token x at the row where it competes, with p that row's target
probabilities (the sampling transform's output; the plain softmax under greedy decoding):
- typical (Medusa, Cai et al. 2024, "typical acceptance"): keep x when p(x) > min(epsilon, sqrt(epsilon) *
  exp(-H(p))), H the entropy of p; Medusa's default epsilon is 0.09 and its recommended alpha sqrt(epsilon).
- threshold (SGLang's --speculative-accept-threshold-single): keep x when p(x) >= t.
A draft the exact rule accepts is still accepted; relaxation only adds acceptances. The token after the kept
path is the target's own (argmax, or drawn from p), as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdecode.errors import SpecDecodeError

DEFAULT_VALUE = {"typical": 0.09, "threshold": 0.3}
RULES = tuple(DEFAULT_VALUE)


@dataclass(frozen=True)
class Relaxed:
    rule: str  # one of RULES
    value: float  # typical: epsilon; threshold: t

    @classmethod
    def parse(cls, text: str) -> Relaxed:
        """'typical', 'typical:0.05', 'threshold', 'threshold:0.4' -> the rule; a clear error otherwise."""
        rule, _, value = text.strip().partition(":")
        if rule not in DEFAULT_VALUE:
            raise SpecDecodeError(f"relaxed acceptance must be one of {', '.join(RULES)} (optionally RULE:VALUE), "
                                  f"got {text!r}")
        try:
            number = float(value) if value else DEFAULT_VALUE[rule]
        except ValueError:
            raise SpecDecodeError(f"relaxed acceptance {text!r}: {value!r} is not a number") from None
        if not 0 < number <= 1 or math.isnan(number):
            raise SpecDecodeError(f"relaxed acceptance {text!r}: the value must be in (0, 1]")
        return cls(rule, number)

    def __str__(self) -> str:
        return f"{self.rule}:{self.value:g}"

    def keeps(self, p: torch.Tensor, parent_rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """p [N+1, V] target probabilities per row; parent_rows, tokens [N] -> [N] bool: the rule keeps node i."""
        p_x = p[parent_rows, tokens]  # [N]
        if self.rule == "threshold":
            return p_x >= self.value
        entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(-1)  # [N+1]
        bar = torch.clamp(math.sqrt(self.value) * torch.exp(-entropy), max=self.value)  # [N+1]
        return p_x > bar[parent_rows]
