"""The decoder block of the Llama family and its parts: RMSNorm, grouped-query attention over a KV cache, the
gated MLP. The trunk (transformer.py), its MTP modules (mtp.py) and the drafter heads are built from these."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.rope import apply_rope
from specdecode.models.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as the reference implementations do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class ZeroCentredRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in float32 and cast back after the weight (as transformers' Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def norm_class(config: ModelConfig) -> type[nn.Module]:
    """The RMSNorm a family's config asks for: weights w meaning x/rms(x) * w, or * (1 + w) (zero-centred)."""
    return ZeroCentredRMSNorm if config.zero_centred_norms else RMSNorm


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        # q, k and v in one matmul: one weight stream per layer instead of three.
        qkv_out = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
        self.qkv = nn.Linear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.o = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, 1, T, D/2]
        sin: torch.Tensor,  # [B, 1, T, D/2]
        cache: KVCache | CacheBatch,
        layer: int,
        mask: torch.Tensor | None,  # [B, 1, T, S] bool, True = may attend; None = every cached slot
    ) -> torch.Tensor:
        batch, new, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv(x).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = q.view(batch, new, heads, dim).transpose(1, 2)  # [B, H, T, D]
        k = k.view(batch, new, kv_heads, dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(batch, new, kv_heads, dim).transpose(1, 2)  # [B, Hkv, T, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.write(layer, k, v)  # [B, Hkv, S, D] each
        # Grouped-query attention without copying K/V: fold each kv head's query group into the query length.
        group = heads // kv_heads
        q = q.reshape(batch, kv_heads, group * new, dim)  # [B, Hkv, G*T, D]
        if mask is not None:
            mask = mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(batch, 1, group * new, -1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, Hkv, G*T, D]
        out = out.reshape(batch, heads, new, dim).transpose(1, 2).reshape(batch, new, heads * dim)
        return self.o(out)


# The gated MLP's activations by name: SwiGLU's, and GeGLU's tanh GELU (Gemma 4's experts, decoder/moe.py).
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None, activation: str = "silu"):
        """`intermediate_size`: a width other than the config's (an expert's, decoder/moe.py); `activation`: the
        gate's, a key of ACTIVATIONS."""
        super().__init__()
        self.intermediate_size = intermediate_size or config.intermediate_size
        self.activation = ACTIVATIONS[activation]
        self.gate_up = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        self.down = nn.Linear(self.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)  # [B, T, I] each
        return self.down(self.activation(gate) * up)


class DecoderLayer(nn.Module):
    """One pre-norm decoder block. Fused kernels replace it with a subclass of the same signature and the
    same submodules (so saved weights keep their names), e.g. kernels/w4a8_decoder.py."""

    rope_dtype: torch.dtype | None = None  # the cos/sin dtype it wants; None = the model's dtype

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden] the residual stream
        cos: torch.Tensor,  # [B, 1, T, D/2]
        sin: torch.Tensor,  # [B, 1, T, D/2]
        cache: KVCache | CacheBatch,
        index: int,  # this layer's index in the cache
        mask: torch.Tensor | None,  # [B, 1, T, S] bool, True = may attend; None = every cached slot
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, index, mask)
        return x + self.mlp(self.mlp_norm(x))

    def unfused(self) -> DecoderLayer:
        """The same weights run by this PyTorch layer: a replacement layer (fused, fixed-order) keeps the submodules,
        so tests can compare the two."""
        layer = DecoderLayer.__new__(DecoderLayer)
        nn.Module.__init__(layer)
        layer.attn_norm, layer.attn, layer.mlp_norm, layer.mlp = self.attn_norm, self.attn, self.mlp_norm, self.mlp
        return layer
