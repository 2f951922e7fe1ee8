"""Rotary position embeddings: one precomputed cos/sin table, indexed by caller-supplied positions."""

from __future__ import annotations

import math

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig, rope_factors: torch.Tensor | None = None) -> torch.Tensor:
    """[rotary_dim/2] float32 inverse frequencies (rotary_dim = head_dim unless the config rotates part of each
    head), with the config's scaling applied."""
    dim = config.rotary_dim or config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope_factors is not None:
        # GGUF files of llama3-scaled models carry the per-frequency divisors as a tensor instead of a config.
        return (inv_freq / rope_factors.double()).float()
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.float()
    kind = scaling["rope_type"]
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        return _llama3(inv_freq, scaling).float()
    raise SpecDecodeError(f"unsupported rope scaling {kind!r}; supported: linear, llama3")


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths scaled down, short kept, a smooth blend between."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # [D/2]
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)  # [D/2]
    blended = (1 - smooth) * scaled / factor + smooth * scaled  # [D/2]
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)  # [D/2]
    return torch.where(is_medium, blended, scaled)


class RopeTable:
    """cos/sin for every position up to the context limit, built once so a decode step only indexes."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, device: torch.device):
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq.float())  # [P, D/2]
        self.cos = torch.cos(angles).to(device=device, dtype=dtype)  # [P, D/2]
        self.sin = torch.sin(angles).to(device=device, dtype=dtype)  # [P, D/2]

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin each [B, 1, T, D/2], broadcastable over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated in the half-split (NeoX) layout that HF checkpoints use; with partial rotary (cos and
    sin [..., R/2], R < D: GLM-4.5) the first R dims of each head are rotated and the rest pass through."""
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
