"""The DFlash drafter (z-lab, arXiv 2602.06036): a few Qwen3-style layers that denoise a whole block at once.

The target's hidden states at several layers are fused into context features C = hidden_norm(fc(concat)), and
every draft layer reads C as extra keys and values (its own k/v projections, k_norm and rope at the context
positions; C skips the layer's input norm). A block is the last committed token followed by B-1 mask tokens,
embedded by the target; the layers attend non-causally over the cached context and the whole block, and slot
j >= 1 predicts the token at its own position through the target's head. One forward drafts B-1 tokens. As the
reference (PyPI `dflash`, dflash/model.py) computes it:

    C     = hidden_norm(fc(concat_k h_{id_k + 1}))         ids in "output of layer k" convention
    X     = embed([x_root, MASK, ..., MASK]) * input_embedding_scale
    layer: Xn = input_norm(X); q from Xn; k, v from [C ; Xn]; X += o(attn); X += mlp(post_norm(X))
    logits = head(norm(X))[1:] * output_multiplier          (tanh soft-capped when the config says so)

Sliding-window layers are causal within their window unless the config says otherwise (the reference's rule).

Where every matmul is w4a8 (row-invariant), the attention can run in the compiled fixed-order kernel instead
(`fixed_attend`, set by batch_invariance.fix_dflash_attention): several sequences' blocks then share one forward
(`blocks_hidden`) and each slot gets bitwise what it gets alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.decoder.kv_cache import KVCache
from specdecode.models.decoder.layers import MLP, RMSNorm
from specdecode.models.decoder.rope import RopeTable, apply_rope, inverse_frequencies
from specdecode.models.heads.draft_vocab import spread_to_vocab
from specdecode.models.model_config import ModelConfig


@dataclass(frozen=True)
class DFlashConfig:
    layer: ModelConfig  # the draft layers' sizes, rope and biases (num_layers = draft layers; the target's vocab)
    target_layer_ids: tuple[int, ...]  # as the checkpoint names them: output of target layer k
    block_size: int  # slots per block: the root and block_size - 1 masks
    mask_token_id: int
    target_hidden_size: int
    causal_layers: tuple[bool, ...]  # per draft layer: causal attention within the block
    windows: tuple[int | None, ...]  # per draft layer: its sliding window, None for full attention
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    logit_softcap: float | None = None

    @property
    def boundary_ids(self) -> tuple[int, ...]:
        """Our boundary ids (DESIGN.md) for the target states read: the output of layer k is boundary k + 1."""
        return tuple(i + 1 for i in self.target_layer_ids)


class DFlashLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, heads, kv_heads, dim = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.heads, self.kv_heads, self.dim = heads, kv_heads, dim
        self.attn_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.q = nn.Linear(hidden, heads * dim, bias=config.qkv_bias)
        self.kv = nn.Linear(hidden, 2 * kv_heads * dim, bias=config.qkv_bias)  # k and v stacked
        self.o = nn.Linear(heads * dim, hidden, bias=config.o_bias)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(dim, config.rms_norm_eps)
        self.mlp_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.mlp = MLP(config)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (context features, or the block after the input norm) -> keys, values [1, Hkv, T, D]."""
        k, v = self.kv(x).view(x.shape[0], 2, self.kv_heads, self.dim).unbind(1)  # [T, Hkv, D] each
        k = apply_rope(self.k_norm(k).transpose(0, 1).unsqueeze(0), cos, sin)  # [1, Hkv, T, D]
        return k, v.transpose(0, 1).unsqueeze(0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_keys: torch.Tensor,
                context_values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, H] the block; cos, sin [1, 1, B, D/2]; context keys/values [1, Hkv, C, D]; mask [B, C+B] bool or
        None (everything visible) -> [B, H]."""
        normed = self.attn_norm(x)
        q = self.q(normed).view(x.shape[0], self.heads, self.dim)  # [B, h, D]
        q = apply_rope(self.q_norm(q).transpose(0, 1).unsqueeze(0), cos, sin)  # [1, h, B, D]
        k, v = self.keys_values(normed, cos, sin)  # [1, Hkv, B, D] each
        keys = torch.cat([context_keys, k], dim=2).repeat_interleave(self.heads // self.kv_heads, dim=1)
        values = torch.cat([context_values, v], dim=2).repeat_interleave(self.heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [1, h, B, D]
        x = x + self.o(out[0].transpose(0, 1).reshape(x.shape[0], self.heads * self.dim))
        return x + self.mlp(self.mlp_norm(x))

    def fixed_order_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[KVCache],
                            index: int, visible: torch.Tensor, attend) -> torch.Tensor:
        """Several blocks, each over its own cache: x [N, B, H]; cos, sin [N, 1, B, D/2]; visible [N, 1, B, S]
        bool over each cache's slots (its context, then its block's slots written after it) -> [N, B, H]. As
        `forward`, with the attention in the compiled fixed-order kernel `attend`, which writes the blocks' keys
        and values after each context (past its length: they stay out of it) and sums each row's visible slots
        in slot order, so a block's bits do not depend on the others."""
        count, size, _ = x.shape
        normed = self.attn_norm(x)
        q = self.q(normed).view(count, size, self.heads, self.dim)  # [N, B, h, D]
        k, v = self.kv(normed).view(count, size, 2, self.kv_heads, self.dim).unbind(2)  # [N, B, Hkv, D] each
        q = apply_rope(self.q_norm(q).transpose(1, 2), cos, sin).transpose(1, 2)  # [N, B, h, D]
        k = apply_rope(self.k_norm(k).transpose(1, 2), cos, sin).transpose(1, 2)  # [N, B, Hkv, D]
        qkv = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1).float().contiguous()  # [N, B, width]
        keys = [cache.keys[index, 0] for cache in caches]  # [Hkv, S_n, D] each, written in place
        values = [cache.values[index, 0] for cache in caches]
        starts = [cache.lengths[0] for cache in caches]
        out = attend(qkv, keys, values, starts, visible, self.heads, self.kv_heads, self.dim)  # [N, B, h*D] fp32
        x = x + self.o(out.to(x.dtype))
        return x + self.mlp(self.mlp_norm(x))


class DFlashModel(nn.Module):
    def __init__(self, config: DFlashConfig, target_embed: nn.Embedding, target_head: nn.Module):
        super().__init__()
        self.config = config
        layer = config.layer
        self.fc = nn.Linear(config.target_hidden_size * len(config.target_layer_ids), layer.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(layer) for _ in range(layer.num_layers))
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        # The target's, not owned: kept out of this module's parameters (and its state dict).
        self._shared = {"embed": target_embed, "head": target_head}
        self.rope: RopeTable | None = None
        self.draft_head: nn.Linear | None = None  # a reduced draft vocabulary's own rows (use_draft_vocabulary)
        self.draft_to_target: torch.Tensor | None = None  # [Vd] long: the target id of each draft-head row
        self.fixed_attend = None  # the compiled fixed-order attention, where it makes blocks batch-invariant

    def use_draft_vocabulary(self, ids: torch.Tensor, head: nn.Linear) -> None:
        """Draft over the target ids `ids` [Vd] only, through `head` (their output rows); other tokens get -inf,
        so they are never drafted and the drafts' law stays a law over the target's vocabulary."""
        self.draft_head = head.to(dtype=self.dtype, device=self.device)
        self.draft_to_target = ids.to(self.device)

    def finish_loading(self, max_positions: int) -> None:
        """Once weights, dtype and device are final: the drafter's own rope table."""
        self.rope = RopeTable(inverse_frequencies(self.config.layer), max_positions, self.dtype, self.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, capacity: int) -> KVCache:
        layer = self.config.layer
        return KVCache(layer.num_layers, 1, layer.num_kv_heads, layer.head_dim, capacity, self.dtype, self.device)

    def add_context(self, states: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> None:
        """The target's states [T, n_aux * Ht] (boundary order) at positions [T] -> every layer's context keys and
        values, appended to the cache."""
        context = self.hidden_norm(self.fc(states.to(self.dtype)))  # [T, H]
        cos, sin = self.rope.lookup(positions.view(1, -1))
        for index, layer in enumerate(self.layers):
            k, v = layer.keys_values(context, cos, sin)
            cache.write(index, k, v)
        cache.record_positions(positions.view(1, -1))
        cache.advance(positions.numel())

    def embed_block(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [N] -> [N, H]: the target's embedding, scaled as the config says."""
        return self._shared["embed"](tokens).to(self.dtype) * self.config.input_embedding_scale

    def block_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B] (the root, then masks) at positions [B] over the cached context -> [B, H], every slot after
        the output norm (the context is left as it was)."""
        x = self.embed_block(tokens)  # [B, H]
        cos, sin = self.rope.lookup(positions.view(1, -1))  # [1, 1, B, D/2]
        used = cache.lengths[0]
        for index, layer in enumerate(self.layers):
            mask = self._mask(index, cache.positions[0, :used], positions)
            x = layer(x, cos, sin, cache.keys[index, :, :, :used], cache.values[index, :, :, :used], mask)
        return self.norm(x)

    def blocks_hidden(self, tokens: torch.Tensor, positions: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """As block_hidden for N sequences in one forward, each block over its own cache, through the fixed-order
        attention (needs `fixed_attend`; each cache needs room for a block after its context): tokens, positions
        [N, B] -> [N, B, H], each block's rows bitwise what they are alone."""
        count, size = tokens.shape
        x = self.embed_block(tokens.reshape(-1)).view(count, size, -1)  # [N, B, H]
        cos, sin = self.rope.lookup(positions)  # [N, 1, B, D/2] each
        seen = max(cache.lengths[0] for cache in caches) + size  # S: the longest context and its block
        masks: dict[tuple, torch.Tensor] = {}  # layers attending alike share one mask
        for index, layer in enumerate(self.layers):
            rule = (self.config.causal_layers[index], self.config.windows[index])
            if rule not in masks:
                masks[rule] = self._visible_slots(index, caches, positions, seen)
            x = layer.fixed_order_forward(x, cos, sin, caches, index, masks[rule], self.fixed_attend)
        return self.norm(x)

    def _visible_slots(self, layer: int, caches: list[KVCache], positions: torch.Tensor, seen: int) -> torch.Tensor:
        """[N, 1, B, S] bool: what each block's slots see of its cache in layer `layer` (its context, then its
        block), False past them."""
        visible = torch.zeros(positions.shape[0], 1, positions.shape[1], seen, dtype=torch.bool,
                              device=positions.device)  # [N, 1, B, S]
        for n, cache in enumerate(caches):
            used = cache.lengths[0]
            own = self._mask(layer, cache.positions[0, :used], positions[n])  # [B, C+B] or None
            visible[n, 0, :, : used + positions.shape[1]] = True if own is None else own
        return visible

    @property
    def output_head(self) -> nn.Module:
        """The layer the drafts' logits come from: the target's head, or the draft vocabulary's rows."""
        return self._shared["head"] if self.draft_head is None else self.draft_head

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] after the output norm -> logits [N, V] float32 through the target's head (or the draft
        vocabulary's rows, -inf elsewhere)."""
        logits = self.output_head(hidden).float() * self.config.output_multiplier  # [N, V or Vd]
        if self.config.logit_softcap:
            logits = torch.tanh(logits / self.config.logit_softcap) * self.config.logit_softcap
        if self.draft_to_target is None:
            return logits
        return spread_to_vocab(logits, self.draft_to_target, self.config.layer.vocab_size)  # [N, V]

    def block_logits(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens [B] (the root, then masks) at positions [B] over the cached context -> logits [B-1, V] float32
        for slots 1..B-1, the drafting slots in z-lab's convention."""
        return self.head_logits(self.block_hidden(tokens, positions, cache)[1:])

    def _mask(self, layer: int, context_positions: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """[B, C+B] bool: what each block slot sees in layer `layer` (None: everything)."""
        causal, window = self.config.causal_layers[layer], self.config.windows[layer]
        if not causal and window is None:
            return None
        keys = torch.cat([context_positions, positions])  # [C+B]
        visible = torch.ones(positions.numel(), keys.numel(), dtype=torch.bool, device=positions.device)
        gap = positions.view(-1, 1) - keys.view(1, -1)  # [B, C+B] query position - key position
        if causal:
            visible &= gap >= 0
        if window is not None:
            visible &= gap < window
            if not causal:
                visible &= -gap < window
        return visible
