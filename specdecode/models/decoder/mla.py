"""Multi-head latent attention (MLA; DeepSeek-V2 2024, used by DeepSeek-V3 and GLM-4.7-Flash), as transformers'
DeepseekV3Attention computes it:

    q            = q_b(q_a_norm(q_a(x)))  (or q(x) where q_lora_rank is None)   [nh, nope + rope] per token
    c, k_rope    = kv_a(x): c = kv_a_norm(first kv_lora_rank), k_rope rotated   [C] and [R] per token, one for all heads
    k_nope, v    = kv_b(c) per head                                             [nope] and [v] per head
    attention over [q_nope | q_rope] . [k_nope | k_rope], softmax scale (nope + rope)^-0.5 * YaRN's mscale^2, then o

The cache keeps only c and k_rope per token (latent_cache.py). Three forms compute the same attention:

- expanded (a long prefill chunk): kv_b rebuilds k_nope and v for every visible slot, then ordinary attention;
- absorbed (decoding and verifying, a few rows against a long cache): kv_b's key half W_UK is folded into the
  query, q_nope W_UK per head, so scores read the latents directly; attention sums latents, and kv_b's value half
  W_UV turns each head's sum into its value (DeepSeek-V2's "absorb" of W_UK and W_UV);
- fixed-order absorbed: the absorbed form with the attention in the compiled kernel (kernels/attention.cpp) and
  every head's products in one compiled call (kernels/head_products.cpp), each summing in a fixed order, so a
  token's bits do not depend on the rows beside it (the engine's lossless promise; installed by `fix`, which every
  forward then takes, prefill included, so a row's result never depends on the size of the forward it is in).

kv_b is a float parameter, not an nn.Linear: both forms read it per head, and quantizers leave it as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.layers import RMSNorm
from specdecode.models.decoder.rope import apply_rope, apply_rope_interleaved, yarn_mscale
from specdecode.models.model_config import ModelConfig

# From this many new rows a forward of the PyTorch layers rebuilds keys and values (the expanded form): a prefill
# chunk's rows share the rebuild; fewer rows (decoding, verifying) read the latents directly.
EXPANDED_FROM = 32


@dataclass(frozen=True)
class MLAConfig:
    """A config's latent-attention sizes (ModelConfig.mla)."""

    q_lora_rank: int | None  # the query's low-rank width; None: a plain q_proj
    kv_lora_rank: int  # C: the cached latent's width
    qk_nope_head_dim: int  # each head's key part rebuilt from the latent
    qk_rope_head_dim: int  # R: the rotary part, one key for all heads
    v_head_dim: int  # each head's value width
    rope_interleave: bool = True  # rotated pairs are neighbours (DeepSeek's weights), else the two halves
    attention_bias: bool = False  # biases on q_a, kv_a and o
    # transformers builds q_a_layernorm and kv_a_layernorm without an eps, so 1e-6 whatever rms_norm_eps says
    latent_norm_eps: float = 1e-6

    def check(self, config: ModelConfig) -> None:
        sizes = {"kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
                 "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim}
        if self.q_lora_rank is not None:
            sizes["q_lora_rank"] = self.q_lora_rank
        for name, value in sizes.items():
            if type(value) is not int or value < 1:
                raise SpecDecodeError(f"config: {name} must be a positive integer, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise SpecDecodeError(f"config: qk_rope_head_dim must be even (rope rotates pairs), got "
                                  f"{self.qk_rope_head_dim}")
        if config.head_dim != self.qk_rope_head_dim:
            raise SpecDecodeError(f"config: head_dim ({config.head_dim}) must equal qk_rope_head_dim "
                                  f"({self.qk_rope_head_dim}): the rotary table covers the rotary part")

    @property
    def width(self) -> int:
        """One token's cached row in one layer: the latent and the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_scale(self, config: ModelConfig) -> float:
        """(nope + rope)^-0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the config scales rope
        with it (DeepSeek's reference and transformers' yarn_apply_mscale: the non-rotary dims too)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        scaling = config.rope_scaling or {}
        if scaling.get("rope_type", "default") != "default" and scaling.get("mscale_all_dim"):
            factor = scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"]
            scale *= yarn_mscale(factor, scaling["mscale_all_dim"]) ** 2
        return scale


class LatentAttention(nn.Module):
    expand_from = EXPANDED_FROM  # the rows from which the PyTorch form rebuilds keys and values (tests vary it)

    def __init__(self, config: ModelConfig):
        super().__init__()
        mla = config.mla
        self.mla = mla
        self.num_heads = config.num_heads
        hidden, heads, query = config.hidden_size, config.num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = mla.attention_bias
        if mla.q_lora_rank is None:
            self.q = nn.Linear(hidden, heads * query, bias=False)
        else:
            self.q_a = nn.Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, mla.latent_norm_eps)
            self.q_b = nn.Linear(mla.q_lora_rank, heads * query, bias=False)
        self.kv_a = nn.Linear(hidden, mla.width, bias=bias)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, mla.latent_norm_eps)
        self.kv_b = nn.Parameter(torch.empty(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))
        self.o = nn.Linear(heads * mla.v_head_dim, hidden, bias=bias)
        self.scale = mla.softmax_scale(config)
        self.rotate = apply_rope_interleaved if mla.rope_interleave else apply_rope
        # Set by `fix`: the compiled attention and per-head products, and kv_b's halves in the layout the products
        # read (plain attributes, not buffers: kv_b's values in another layout, never saved or loaded; kv_b is).
        self.attend = None
        self.head_products = None
        self.key_weights: torch.Tensor | None = None  # [nh, nope, C]: W_UK, a head's query part -> its latent query
        self.value_weights: torch.Tensor | None = None  # [nh, C, v]: W_UV^T, a head's latent sum -> its value
        self.key_scales: torch.Tensor | None = None  # [nh, C] float32 where the key weights are int8 codes
        self.value_scales: torch.Tensor | None = None  # [nh, v] float32 where the value weights are int8 codes

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b per head: W_UK [nh, nope, C] (keys) and W_UV [nh, v, C] (values)."""
        mla = self.mla
        per_head = self.kv_b.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        return per_head.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)

    def fix(self, kernel, int8: bool = False) -> None:
        """Take the fixed-order form: the compiled extension's `attend` and `head_products` (kernels/); `int8`: the
        per-head weights as int8 codes with a scale a column (a quantized model's: half the bytes a step reads,
        as llama.cpp's 8-bit attn_k_b and attn_v_b), else in the model's dtype."""
        w_uk, w_uv = (part.detach() for part in self.up_weights())  # [nh, nope, C], [nh, v, C]
        self.key_weights, self.key_scales = head_weights(w_uk, int8)
        self.value_weights, self.value_scales = head_weights(w_uv.transpose(1, 2), int8)
        self.attend, self.head_products = kernel.attend, kernel.head_products

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, nh, nope + rope]."""
        q = self.q(x) if self.mla.q_lora_rank is None else self.q_b(self.q_a_norm(self.q_a(x)))
        return q.view(*x.shape[:2], self.num_heads, -1)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, hidden]
        cos: torch.Tensor,  # [B, 1, T, R/2]
        sin: torch.Tensor,  # [B, 1, T, R/2]
        cache: KVCache | CacheBatch,  # latent caches (latent_cache.py)
        layer: int,
        mask: torch.Tensor | None,  # [B, 1, T, S] bool, True = may attend; None = every cached slot
    ) -> torch.Tensor:
        mla = self.mla
        q_nope, q_rope = self.queries(x).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)  # [B, T, nh, *]
        latent, k_rope = self.kv_a(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)  # [B, T, C], [B, T, R]
        q_rope = self.rotate(q_rope, cos.transpose(1, 2), sin.transpose(1, 2))  # [B, T, nh, R]
        k_rope = self.rotate(k_rope, cos[:, 0], sin[:, 0])  # [B, T, R]
        rows = torch.cat([self.kv_a_norm(latent), k_rope], dim=-1)  # [B, T, W]: what the cache keeps
        if self.attend is not None:
            return self.fixed_order(q_nope, q_rope, rows, cache, layer, mask)
        seen, _ = cache.write(layer, rows.unsqueeze(1), rows.new_empty(*rows.shape[:2], 0).unsqueeze(1))  # [B, 1, S, W]
        form = self.expanded if x.shape[1] >= self.expand_from else self.absorbed
        return self.o(form(q_nope, q_rope, seen, mask).flatten(2))

    def expanded(self, q_nope: torch.Tensor, q_rope: torch.Tensor, seen: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """q_nope [B, T, nh, nope], q_rope [B, T, nh, R], seen [B, 1, S, W] -> [B, T, nh, v]: keys and values
        rebuilt from every visible latent."""
        mla, heads = self.mla, self.num_heads
        batch, _, slots, _ = seen.shape
        latents, k_rope = seen.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)  # [B, 1, S, C], [B, 1, S, R]
        rebuilt = F.linear(latents[:, 0], self.kv_b).view(batch, slots, heads, -1).transpose(1, 2)  # [B, nh, S, nope+v]
        k_nope, values = rebuilt.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        keys = torch.cat([k_nope, k_rope.expand(batch, heads, slots, -1)], dim=-1)  # [B, nh, S, nope+R]
        query = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # [B, nh, T, nope+R]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=self.scale)  # [B, nh, T, v]
        return out.transpose(1, 2)

    def absorbed(self, q_nope: torch.Tensor, q_rope: torch.Tensor, seen: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """As `expanded`, attending over the latents themselves: one key and value head [W] for all query heads."""
        batch, new, heads, _ = q_nope.shape
        w_uk, w_uv = self.up_weights()  # [nh, nope, C], [nh, v, C]
        q_latent = torch.einsum("bthn,hnc->bhtc", q_nope, w_uk)  # [B, nh, T, C]
        query = torch.cat([q_latent, q_rope.transpose(1, 2)], dim=-1)  # [B, nh, T, W]
        # Every head reads the one latent head: heads folded into the query length, as grouped-query attention.
        query = query.reshape(batch, 1, heads * new, -1)  # [B, 1, nh*T, W]
        if mask is not None:
            mask = mask.unsqueeze(2).expand(-1, -1, heads, -1, -1).reshape(batch, 1, heads * new, -1)
        out = F.scaled_dot_product_attention(query, seen, seen[..., : self.mla.kv_lora_rank], attn_mask=mask,
                                             scale=self.scale)  # [B, 1, nh*T, C]
        return torch.einsum("bhtc,hvc->bthv", out.view(batch, heads, new, -1), w_uv)  # [B, T, nh, v]

    def fixed_order(self, q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor,
                    cache: KVCache | CacheBatch, layer: int, mask: torch.Tensor | None) -> torch.Tensor:
        """The absorbed form with each row's attention summed in ascending slot order by the compiled kernel, which
        writes `rows` [B, T, W] into each sequence's cache in place -> [B, T, hidden]."""
        batch, new, heads, nope = q_nope.shape
        width, latent = self.mla.width, self.mla.kv_lora_rank
        q_nope = q_nope.reshape(batch * new, heads, nope).float().contiguous()  # [B*T, nh, nope]
        q_latent = self.head_products(q_nope, self.key_weights, self.key_scales)  # [B*T, nh, C] float32
        q_latent = q_latent.view(batch, new, heads, latent)  # [B, T, nh, C]
        # The kernel scales scores by width^-0.5: the query carries the rest of the softmax scale.
        query = torch.cat([q_latent, q_rope.float()], dim=-1) * (self.scale * math.sqrt(width))  # [B, T, nh, W]
        # One key head and one value head, both the cached row (the kernel writes it twice, to the same slot).
        qkv = torch.cat([query.flatten(2), rows, rows], dim=-1).float()  # [B, T, (nh + 2) * W]
        caches, _ = cache.layer_views(layer)  # one [1, S, W] tensor per sequence
        attended = self.attend(qkv, caches, caches, cache.lengths, mask, heads, 1, width)  # [B, T, nh*W] float32
        summed = attended.view(batch * new, heads, width)[..., :latent].contiguous()  # [B*T, nh, C] float32
        values = self.head_products(summed, self.value_weights, self.value_scales)  # [B*T, nh, v] float32
        return self.o(values.view(batch, new, -1).to(rows.dtype))


def head_weights(weights: torch.Tensor, int8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """weights [nh, n, m] -> (the same, contiguous, and None), or int8 codes [nh, n, m] with a float32 scale a column
    [nh, m]: symmetric, code = round(w / scale), scale = the column's largest |w| / 127."""
    if not int8:
        return weights.contiguous(), None
    wide = weights.float()
    scales = wide.abs().amax(dim=1).clamp_min(1e-12) / 127  # [nh, m]
    codes = torch.round(wide / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)  # [nh, n, m]
    return codes.contiguous(), scales.contiguous()
