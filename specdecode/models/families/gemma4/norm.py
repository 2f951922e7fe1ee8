"""Gemma 4's RMSNorm, which its layers, its experts' block and its trunk share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * w, all in float32 and cast back once (Gemma 4's weights are not zero-centred); without a
    weight for the values' norm."""

    def __init__(self, dim: int, eps: float, with_weight: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_weight else None
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op (a decode step runs about 7 norms a layer); rsqrt where transformers writes pow(-0.5).
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).to(x.dtype)
