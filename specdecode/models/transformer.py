"""Our decoder for the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3): one implementation, config-driven.

Built for speculative decoding: the caller supplies positions (tree nodes share them), an optional mask over the
new tokens, which positions need logits, and which hidden states to return (boundary ids, see DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.kv_cache import CacheBatch, KVCache
from specdecode.models.model_config import ModelConfig
from specdecode.models.rope import RopeTable, apply_rope, inverse_frequencies


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


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate_size, dim=-1)  # [B, T, I] each
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One pre-norm decoder block. Fused kernels replace it with a subclass of the same signature and the
    same submodules (so saved weights keep their names), e.g. quant/w4a8_decoder.py."""

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


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, T', V] float32, T' = len(logits_at) or T
    hidden: dict[int, torch.Tensor]  # boundary id -> [B, T, hidden]
    final_hidden: torch.Tensor | None = None  # [B, T, hidden] after the final norm, when asked for


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Imported here: mtp.py builds on this module's layers.
        from specdecode.models.mtp import MTPModule

        # Multi-token-prediction modules the weights ship (plain decoding never runs them; drafters/mtp.py does).
        self.mtp = nn.ModuleList(MTPModule(config) for _ in range(config.mtp_layers))
        self.rope: RopeTable | None = None
        self.rope_factors: torch.Tensor | None = None

    def finish_loading(self, rope_factors: torch.Tensor | None = None) -> None:
        """Once the weights (and so dtype and device) are final: tie a float output head to the embedding where
        the config says so (a quantized head has its own copy), and build the cos/sin table."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.embed.weight
        self.rope_factors = rope_factors  # [D/2] llama3 divisors from a GGUF file; kept so a saved copy has them
        weight = self.embed.weight
        inv_freq = inverse_frequencies(self.config, rope_factors)
        rope_dtype = self.layers[0].rope_dtype or weight.dtype  # fused layers take float32 cos/sin
        self.rope = RopeTable(inv_freq, self.config.max_position_embeddings, rope_dtype, weight.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, capacity: int, batch_size: int = 1) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, batch_size, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The output head's rows for `ids` [Vd] -> [Vd, H] float32, whatever the head's storage: its output on the
        identity matrix is its weight (one-hot rows quantize exactly to int8, so this holds for w4a8 too)."""
        hidden = self.config.hidden_size
        with torch.inference_mode():
            eye = torch.eye(hidden, dtype=self.dtype, device=self.device)  # [H, H]
            columns = torch.cat([self.lm_head(eye[i : i + 256])[:, ids.to(self.device)] for i in range(0, hidden, 256)])
        return columns.T.float().contiguous()  # [Vd, H]

    def new_mtp_cache(self, capacity: int) -> KVCache:
        """A cache for one MTP module's attention (one layer, one sequence)."""
        c = self.config
        return KVCache(1, 1, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    def mtp_forward(self, index: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    cache: KVCache | CacheBatch, attn_mask: torch.Tensor | None = None,
                    logits_at: torch.Tensor | slice | None = None, head: nn.Module | None = None,
                    modules: nn.ModuleList | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP module `index` over tokens [B, T] (each the token after its hidden state's), hidden [B, T, H],
        positions [B, T] (the hidden states' positions); cache, attn_mask and logits_at as forward's; `head`
        replaces lm_head (a reduced draft vocabulary); `modules` replace the model's own (a companion file's).
        -> (logits [B, T', V or Vd] float32, the hidden a further step feeds back [B, T, H])."""
        new = tokens.shape[1]
        cache.check_room(new)
        mask = attention_mask(positions, cache, attn_mask, self.config.sliding_window)
        cos, sin = (part.to(self.dtype) for part in self.rope.lookup(positions))  # fused trunks keep float32
        cache.record_positions(positions)
        module = (self.mtp if modules is None else modules)[index]
        head_input, fed_back = module(self.embed(tokens), hidden.to(self.dtype), cos, sin, cache, mask)
        cache.advance(new)
        head_input = pick_rows(head_input, logits_at)
        return (self.lm_head if head is None else head)(head_input).float(), fed_back

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        cache: KVCache | CacheBatch,  # one batch of caches, or several sequences each with its own
        # [B, T, R+T] bool: which of the last R cached slots and of the new tokens each new token may see (the
        # earlier past is always visible; R = 0 for a tree of new tokens); None = causal
        attn_mask: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),  # boundary ids of the residual stream to return
        # which of the T positions need logits: the same for every sequence ([T'] or a slice), or each its own
        # ([B, T'] long); None = all
        logits_at: torch.Tensor | slice | None = None,
        final_hidden: bool = False,  # also return every position's hidden state after the final norm
    ) -> ForwardOutput:
        new = tokens.shape[1]
        cache.check_room(new)
        mask = attention_mask(positions, cache, attn_mask, self.config.sliding_window)
        cos, sin = self.rope.lookup(positions)
        cache.record_positions(positions)
        x = self.embed(tokens)  # [B, T, hidden]
        hidden = {0: x} if 0 in hidden_layers else {}
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, index, mask)  # fused layers keep it in float32
            if index + 1 in hidden_layers:
                hidden[index + 1] = x.to(self.dtype)
        cache.advance(new)
        if final_hidden:
            normed = self.norm(x)  # [B, T, hidden]
            return ForwardOutput(self.lm_head(pick_rows(normed, logits_at)).float(), hidden, normed.to(self.dtype))
        logits = self.lm_head(self.norm(pick_rows(x, logits_at))).float()  # [B, T', V]
        return ForwardOutput(logits, hidden)


def pick_rows(x: torch.Tensor, at: torch.Tensor | slice | None) -> torch.Tensor:
    """x [B, T, H] -> the rows `at`: None = all, a slice or [T'] = the same rows of every sequence, [B, T'] = each
    sequence its own."""
    if at is None:
        return x
    if isinstance(at, torch.Tensor) and at.dim() == 2:
        return x.gather(1, at.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # [B, T', H]
    return x[:, at]


def attention_mask(positions: torch.Tensor, cache: KVCache | CacheBatch, tree: torch.Tensor | None,
                   window: int | None = None) -> torch.Tensor | None:
    """[B, 1, T, S] bool over the slots a query may see: all earlier slots plus its own new tokens.

    positions [B, T] of the new tokens; tree [B, T, R+T] (see Transformer.forward's attn_mask) or None = causal;
    window: a sliding window in positions, or None. None back means every cached slot (one new token each).
    """
    batch, new = positions.shape
    used = max(cache.lengths) + new
    uniform = len(set(cache.lengths)) == 1
    needs_window = window is not None and used > window
    if new == 1 and uniform and tree is None and not needs_window:
        return None  # one new token per sequence sees every cached slot
    device = positions.device
    starts = torch.tensor(cache.lengths, device=device).view(batch, 1, 1)  # [B, 1, 1] first new slot
    relative = torch.arange(used, device=device).view(1, 1, used) - starts  # [B, 1, S] index among new
    query = torch.arange(new, device=device).view(1, new, 1)  # [1, T, 1] each query's index among new
    if tree is None:
        visible = relative <= query  # [B, T, S]: causal over new tokens, all of the past
    else:
        covered = tree.shape[2]  # R trailing cached slots + the T new ones
        column = relative + (covered - new)  # [B, 1, S] index into the mask's columns; < 0 = older past
        in_mask = (column >= 0) & (relative < new)  # [B, 1, S]
        tree_cols = tree.gather(2, column.clamp(0, covered - 1).expand(batch, new, used))  # [B, T, S]
        visible = (column < 0) | (in_mask & tree_cols)
    if needs_window:
        key_positions = cache.key_positions(used).unsqueeze(1).clone()  # [B, 1, S], new slots filled below
        for b, start in enumerate(cache.lengths):
            key_positions[b, 0, start : start + new] = positions[b]
        visible = visible & (key_positions > positions.unsqueeze(2) - window)
    return visible.unsqueeze(1)
