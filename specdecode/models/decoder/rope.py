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
    if kind == "yarn":
        return _yarn(dim, config)
    raise SpecDecodeError(f"unsupported rope scaling {kind!r}; supported: linear, llama3, yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction (its Eq. 21): 0.1 * mscale * ln(factor) + 1, or 1 where nothing is scaled."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(config: ModelConfig) -> float:
    scaling = config.rope_scaling
    # DeepSeek-V3's configs may leave the factor out: the context's growth over the pretrained one is it.
    return scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"]


def attention_factor(config: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1 for every other rope): the config's attention_factor, or
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are given (DeepSeek: 1), else
    mscale(factor), as transformers computes it."""
    scaling = config.rope_scaling
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(config)
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    return yarn_mscale(factor)


def _yarn(dim: int, config: ModelConfig) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies that turn more than beta_fast times over the pretrained context kept,
    those that turn fewer than beta_slow times divided by the factor, a linear ramp between; computed in float32
    as transformers' _compute_yarn_parameters computes them."""
    scaling = config.rope_scaling
    base, factor = config.rope_theta, _yarn_factor(config)
    old_context = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension turning `rotations` times over the old context
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # a ramp of no width would divide by zero
    frequencies = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [D/2]
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2] 1 = interpolate
    kept = 1 - ramp  # [D/2] the share of each frequency left as it was
    return (1.0 / (factor * frequencies)) * (1 - kept) + (1.0 / frequencies) * kept


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

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype, device: torch.device,
                 scale: float = 1.0):
        """`scale`: what cos and sin are multiplied by (YaRN's attention factor, `attention_factor`)."""
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq.float())  # [P, D/2]
        self.cos = (torch.cos(angles) * scale).to(device=device, dtype=dtype)  # [P, D/2]
        self.sin = (torch.sin(angles) * scale).to(device=device, dtype=dtype)  # [P, D/2]

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


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] whose rotated pairs are neighbours (x0, x1), (x2, x3), ... (DeepSeek's rope_interleave), each
    pair turned by one frequency; the result de-interleaved, [evens | odds], as transformers' DeepSeek-V3 returns
    it (attention scores only see q.k, which the order leaves alone, but the cache keeps this layout)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
