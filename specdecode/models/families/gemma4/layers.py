"""Gemma 4's decoder block and its parts (the trunk is trunk.py; what each part does is in config.py).

A layer that computes keys and values writes them to its slot of the KV cache; a KV-shared layer reads the slot
of the last earlier layer of its kind (`cache_layers`) and writes nothing. Sliding and full layers may differ in
head size and KV heads: a cache slot is sized for the larger of each, and a layer's keys and values are laid out in
it as GemmaAttention.to_slot says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.rope import apply_rope
from specdecode.models.families.gemma4.config import layer_shape
from specdecode.models.families.gemma4.moe import GemmaMoEBlock
from specdecode.models.families.gemma4.norm import GemmaRMSNorm
from specdecode.models.model_config import ModelConfig


def cache_layers(config: ModelConfig) -> list[int]:
    """Each layer's slot in the KV cache: its own below the first KV-shared layer, else the last earlier slot of
    its kind."""
    first_shared = config.family_parts.first_shared(config.num_layers)
    slots = list(range(first_shared))
    for kind in config.layer_types[first_shared:]:
        slots.append(max(i for i in range(first_shared) if config.layer_types[i] == kind))
    return slots


class GemmaAttention(nn.Module):
    def __init__(self, config: ModelConfig, kind: str, shares_kv: bool):
        super().__init__()
        self.kind = kind
        self.num_heads = config.num_heads
        self.num_kv_heads, self.head_dim = layer_shape(config, kind)
        self.shares_kv = shares_kv
        # Full layers with attention_k_eq_v have no value projection: the keys' projection is the value.
        self.values_from_keys = config.family_parts.attention_k_eq_v and kind == "full_attention"
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        eps, bias = config.rms_norm_eps, config.qkv_bias
        if shares_kv:
            self.q = nn.Linear(config.hidden_size, q_size, bias=bias)
        else:  # q, k (and v) in one matmul
            self.qkv = nn.Linear(config.hidden_size, q_size + kv_size * (1 if self.values_from_keys else 2), bias=bias)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps)
            self.v_norm = GemmaRMSNorm(self.head_dim, eps, with_weight=False)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.o = nn.Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.attend = None  # the compiled fixed-order attention, where fix_gemma_layers installed it
        self.cache_shape = (self.num_kv_heads, self.head_dim)  # (KV heads, head size) of a cache slot

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, 1, T, D/2] this layer kind's rope
        sin: torch.Tensor,  # [B, 1, T, D/2]
        cache: KVCache | CacheBatch,
        slot: int,  # this layer's (or the layer it shares with) slot in the cache
        mask: torch.Tensor | None,  # [B, 1, T, S] bool, True = may attend; None = every cached slot
    ) -> torch.Tensor:
        batch, new, _ = x.shape
        heads, dim = self.num_heads, self.head_dim
        if self.shares_kv:
            q, k, v = self.q(x), None, None
        else:
            q, k, v = self._project(x)
            k, v = apply_rope(self.k_norm(k), cos, sin), self.v_norm(v)  # [B, Hkv, T, D] each
        q = apply_rope(self.q_norm(q.view(batch, new, heads, dim).transpose(1, 2)), cos, sin)  # [B, H, T, D]
        if self.attend is not None:
            return self.o(self._fixed_order(q, k, v, cache, slot, mask))
        if self.shares_kv:
            keys, values = cache.read(slot, new)  # [B, Hc, S, Dc] each
        else:
            keys, values = cache.write(slot, self.to_slot(k), self.to_slot(v))
        return self.o(attend(q, self.from_slot(keys), self.from_slot(values), mask))

    def to_slot(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, Hkv, T, D] -> [B, Hc, T, Dc] as a cache slot holds it: each KV head repeated Hc/Hkv times in
        place (query head h still meets KV head h // (H/Hc)), zeros after D (adding nothing to q.k or to the
        output). Every reader of the slot undoes it with from_slot."""
        heads, dim = self.cache_shape
        if (heads, dim) == (self.num_kv_heads, self.head_dim):
            return x
        return F.pad(x.repeat_interleave(heads // self.num_kv_heads, dim=1), (0, dim - self.head_dim))

    def from_slot(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hc, S, Dc] -> this layer's [B, Hkv, S, D] (a view)."""
        return x[:, :: self.cache_shape[0] // self.num_kv_heads, :, : self.head_dim]

    def _fixed_order(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                     cache: KVCache | CacheBatch, slot: int, mask: torch.Tensor | None) -> torch.Tensor:
        """The compiled attention (kernels/attention.cpp: each row sums its visible slots in slot order, whatever
        shares the call) over a cache slot as to_slot lays it out, q padded as the keys are and scaled by sqrt(Dc)
        against the kernel's 1/sqrt(Dc). A KV-shared layer passes the keys and values its producer wrote for the
        new tokens, which the kernel writes again unchanged. -> [B, T, H*D]."""
        batch, heads, new, dim = q.shape
        cache_heads, cache_dim = self.cache_shape
        keys, values = cache.layer_views(slot)  # one [Hc, S, Dc] tensor each per sequence
        if k is None:  # the new tokens' rows, as the producer stored them
            k = torch.stack([keys[b][:, start : start + new] for b, start in enumerate(cache.lengths)])
            v = torch.stack([values[b][:, start : start + new] for b, start in enumerate(cache.lengths)])
        else:
            k, v = self.to_slot(k), self.to_slot(v)  # [B, Hc, T, Dc] each
        q = F.pad(q, (0, cache_dim - dim)) * cache_dim ** 0.5  # [B, H, T, Dc]
        qkv = torch.cat([part.transpose(1, 2).flatten(2) for part in (q, k, v)], dim=-1).float()
        out = self.attend(qkv, keys, values, cache.lengths, mask, heads, cache_heads, cache_dim)  # [B, T, H*Dc]
        return out.view(batch, new, heads, cache_dim)[..., :dim].reshape(batch, new, heads * dim).to(q.dtype)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> q [B, T, H*D], k and v [B, Hkv, T, D] (v is k before its norm where values come from keys)."""
        batch, new, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = self.qkv(x).split([q_size, kv_size] + ([] if self.values_from_keys else [kv_size]), dim=-1)
        q, k = parts[0], parts[1].view(batch, new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = k if self.values_from_keys else parts[2].view(batch, new, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, T, D] over keys and values [B, Hkv, S, D], scaled by 1 (Gemma's q and k norms set the scale) ->
    [B, T, H*D]. Grouped-query attention folds each KV head's query group into the query length (no K/V copy)."""
    batch, heads, new, dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = q.reshape(batch, kv_heads, group * new, dim)  # [B, Hkv, G*T, D]
    if mask is not None:
        mask = mask.unsqueeze(2).expand(-1, -1, group, -1, -1).reshape(batch, 1, group * new, -1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0)  # [B, Hkv, G*T, D]
    return out.reshape(batch, heads, new, dim).transpose(1, 2).reshape(batch, new, heads * dim)


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)  # [B, T, I] each
        return self.down(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, per_layer_size: int | None = None):
        """`per_layer_size`: the PLE width (None: the config's; an assistant's layers have none)."""
        super().__init__()
        parts, eps = config.family_parts, config.rms_norm_eps
        self.kind = config.layer_types[index]
        shares_kv = index >= parts.first_shared(config.num_layers)
        self.attn_norm = GemmaRMSNorm(config.hidden_size, eps)
        self.attn = GemmaAttention(config, self.kind, shares_kv)
        self.post_attn_norm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp_norm = GemmaRMSNorm(config.hidden_size, eps)
        wide = 2 if parts.double_wide_mlp and shares_kv else 1
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size * wide)
        self.post_mlp_norm = GemmaRMSNorm(config.hidden_size, eps)
        # With experts (26B-A4B, moe.py) every layer adds their output to the dense MLP's, each normed on its own.
        self.moe = None if config.moe is None else GemmaMoEBlock(config)
        if self.moe is not None:
            self.post_dense_norm = GemmaRMSNorm(config.hidden_size, eps)  # post_feedforward_layernorm_1
        size = parts.per_layer_size if per_layer_size is None else per_layer_size
        if size:
            self.ple_gate = nn.Linear(config.hidden_size, size, bias=False)
            self.ple_projection = nn.Linear(size, config.hidden_size, bias=False)
            self.ple_norm = GemmaRMSNorm(config.hidden_size, eps)
        self.has_ple = bool(size)
        self.layer_scalar = nn.Parameter(torch.ones(1))  # [1] the whole layer's output scale

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden] the residual stream
        cos: torch.Tensor,  # [B, 1, T, D/2] this layer kind's rope
        sin: torch.Tensor,  # [B, 1, T, D/2]
        cache: KVCache | CacheBatch,
        slot: int,  # the cache slot this layer writes or reads
        mask: torch.Tensor | None,  # [B, 1, T, S] bool for this layer's kind
        per_layer_input: torch.Tensor | None = None,  # [B, T, P] this layer's PLE vector
    ) -> torch.Tensor:
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), cos, sin, cache, slot, mask))
        out = self.mlp(self.mlp_norm(x))  # [B, T, hidden]
        if self.moe is not None:
            out = self.post_dense_norm(out) + self.moe(x)
        x = x + self.post_mlp_norm(out)
        if self.has_ple:
            gated = F.gelu(self.ple_gate(x), approximate="tanh") * per_layer_input  # [B, T, P]
            x = x + self.ple_norm(self.ple_projection(gated))
        return x * self.layer_scalar
