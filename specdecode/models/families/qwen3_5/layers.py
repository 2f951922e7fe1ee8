"""The layers of a hybrid trunk (Qwen 3.5 / 3.6, dense or MoE): zero-centred RMSNorm, gated full attention, and a
decoder layer whose token mixer is either that attention or a Gated DeltaNet (gated_deltanet.py), by `layer_types`,
and whose MLP is the gated MLP or, in the MoE models, a mixture of experts with a gated shared expert
(decoder/moe.py).

Gated attention, as transformers' Qwen3_5Attention computes it: q_proj gives each head a query and an output gate
(interleaved per head: [query | gate]); q and k are RMS-normalised per head (zero-centred weights); rope turns
the first rotary_dim dims of each head only; the attention's output is multiplied by sigmoid(gate) before o_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.layers import MLP, ZeroCentredRMSNorm
from specdecode.models.decoder.moe import MoEBlock
from specdecode.models.decoder.rope import apply_rope
from specdecode.models.families.qwen3_5.gated_deltanet import GatedDeltaNet
from specdecode.models.model_config import ModelConfig


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig, cache_index: int):
        super().__init__()
        self.cache_index = cache_index  # which of the cache's KV layers is this layer's
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.rotary_dim = config.rotary_dim or config.head_dim
        # q (with its gate), k and v in one matmul.
        self.split = [2 * self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.qkv = nn.Linear(config.hidden_size, sum(self.split), bias=config.qkv_bias)
        self.o = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attend = None  # the compiled fixed-order attention, where fix_hybrid_layers installed it

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | CacheBatch,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, hidden]; cos, sin [B, 1, T, rotary_dim/2]; mask [B, 1, T, S] or None -> [B, T, hidden]."""
        batch, new, _ = x.shape
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_gate, k, v = self.qkv(x).split(self.split, dim=-1)
        q, gate = q_gate.view(batch, new, heads, 2 * dim).split(dim, dim=-1)  # [B, T, H, D] each
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(k.view(batch, new, kv_heads, dim)).transpose(1, 2)  # [B, Hkv, T, D]
        v = v.view(batch, new, kv_heads, dim).transpose(1, 2)  # [B, Hkv, T, D]
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if self.attend is not None:
            qkv = torch.cat([q.transpose(1, 2).flatten(2), k.transpose(1, 2).flatten(2),
                             v.transpose(1, 2).flatten(2)], dim=-1).float()  # [B, T, (H + 2 Hkv) * D]
            keys, values = cache.layer_views(self.cache_index)  # one [Hkv, S, D] tensor each per sequence
            out = self.attend(qkv, keys, values, cache.lengths, mask, heads, kv_heads, dim).to(x.dtype)
        else:
            keys, values = cache.write(self.cache_index, k, v)  # [B, Hkv, S, D] each
            group = heads // kv_heads  # grouped-query attention: each kv head's query group along the length
            q = q.reshape(batch, kv_heads, group * new, dim)  # [B, Hkv, G*T, D]
            if mask is not None:
                mask = mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(batch, 1, group * new, -1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, Hkv, G*T, D]
            out = out.reshape(batch, heads, new, dim).transpose(1, 2).reshape(batch, new, heads * dim)
        return self.o(out * torch.sigmoid(gate.reshape(batch, new, heads * dim)))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] with its first rotary_dim dims turned."""
        turned = apply_rope(x[..., : self.rotary_dim], cos.to(x.dtype), sin.to(x.dtype))
        return torch.cat([turned, x[..., self.rotary_dim :]], dim=-1)


class HybridDecoderLayer(nn.Module):
    """A pre-norm block: (gated attention or Gated DeltaNet), then the gated MLP."""

    rope_dtype: torch.dtype | None = None

    def __init__(self, config: ModelConfig, kind: str, cache_index: int):
        super().__init__()
        self.kind = kind
        # The dtype the layer computes in, when not the model's: float32 where every matmul is w4a8 (set by
        # families/qwen3_5/kernels.py). Its kernels read and write float32, so a bf16 residual stream would only
        # add conversions (as the Llama family's fused layers, it then keeps the residual stream in float32).
        self.activation_dtype: torch.dtype | None = None
        self.attn_norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if kind == "linear_attention":
            self.mixer = GatedDeltaNet(config, cache_index)
        else:
            self.mixer = GatedAttention(config, cache_index)
        self.mlp_norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoEBlock(config) if config.moe is not None else MLP(config)  # Qwen 3.5 MoE: experts everywhere

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | CacheBatch,
                index: int, mask: torch.Tensor | None) -> torch.Tensor:
        """As DecoderLayer.forward; `index` is not used (each mixer knows its place in the cache)."""
        if self.activation_dtype is not None:
            x = x.to(self.activation_dtype)
        normed = self.attn_norm(x)
        if self.kind == "linear_attention":
            x = x + self.mixer(normed, cache)
        else:
            x = x + self.mixer(normed, cos, sin, cache, mask)
        return x + self.mlp(self.mlp_norm(x))


def layer_kinds(config: ModelConfig) -> list[tuple[str, int]]:
    """Each layer's (kind, index among the layers of its kind: its place in the cache)."""
    kinds, counts = [], {"full_attention": 0, "linear_attention": 0}
    for kind in config.layer_types:
        kinds.append((kind, counts[kind]))
        counts[kind] += 1
    return kinds
