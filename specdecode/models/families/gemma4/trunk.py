"""Gemma 4's text trunk (config.py says what it has) behind the Llama family's Transformer interface, so every
drafter and the engine run over it unchanged.

What differs for them: two rope tables and two attention masks (sliding and full layers), per-layer embeddings
computed once per forward, KV-shared layers that read an earlier layer's cache slot, and soft-capped logits. The
cache has a slot per layer that computes keys and values (gemma_layers.cache_layers).
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.moe import pack_routers
from specdecode.models.decoder.rope import RopeTable
from specdecode.models.decoder.transformer import ForwardOutput, Transformer, attention_mask, pick_rows
from specdecode.models.families.gemma4.config import layer_shape, slot_shape
from specdecode.models.families.gemma4.layers import GemmaDecoderLayer, cache_layers
from specdecode.models.families.gemma4.norm import GemmaRMSNorm
from specdecode.models.model_config import ModelConfig


class GemmaTransformer(Transformer):
    routers_invariant = False  # with experts: whether every router runs on a row-invariant kernel (finish_loading)

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        parts = config.family_parts
        self.slots = cache_layers(config)
        if parts.per_layer_size:
            width = config.num_layers * parts.per_layer_size
            self.per_layer_embed = nn.Embedding(parts.per_layer_vocab, width)
            self.per_layer_projection = nn.Linear(config.hidden_size, width, bias=False)
            self.per_layer_norm = GemmaRMSNorm(parts.per_layer_size, config.rms_norm_eps)
        self.ropes: dict[str, RopeTable] = {}
        # The residual stream's dtype (None: the weights'); float32 where every matmul is w4a8, whose kernel
        # takes float32 rows (kernels.py), saving two conversions a matmul.
        self.activation_dtype: torch.dtype | None = None
        for layer in self.layers:
            layer.attn.cache_shape = self.cache_shape

    @staticmethod
    def build_layers(config: ModelConfig) -> nn.ModuleList:
        return nn.ModuleList(GemmaDecoderLayer(config, index) for index in range(config.num_layers))

    @staticmethod
    def build_norm(config: ModelConfig) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def finish_loading(self, rope_factors: torch.Tensor | None = None) -> None:
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.embed.weight
        weight = self.embed.weight
        dtype = self.activation_dtype or weight.dtype
        self.ropes = {kind: RopeTable(gemma_frequencies(self.config, kind), self.config.max_position_embeddings,
                                      dtype, weight.device) for kind in set(self.config.layer_types)}
        if self.config.moe is not None:
            self.routers_invariant = pack_routers(self)

    def new_cache(self, capacity: int, batch_size: int = 1, rollback_rows: int = 1) -> KVCache:
        heads, dim = self.cache_shape
        return KVCache(len(set(self.slots)), batch_size, heads, dim, capacity, self.dtype, self.device)

    @property
    def cache_shape(self) -> tuple[int, int]:
        """(KV heads, head size) of a cache slot (gemma_config.slot_shape)."""
        return slot_shape(self.config)

    def cache_bytes(self, slots: int, rollback_rows: int = 1) -> int:
        heads, dim = self.cache_shape
        return slots * (2 * len(set(self.slots)) * heads * dim * self.dtype.itemsize + 8)

    def shared_slot(self, kind: str) -> int:
        """The cache slot a layer of `kind` after the KV-shared boundary reads (the last producer of its kind; a
        Gemma 4 assistant reads the same)."""
        first_shared = self.config.family_parts.first_shared(self.config.num_layers)
        return max(i for i in range(first_shared) if self.config.layer_types[i] == kind)

    def embed_scaled(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> [B, T, H] embeddings times sqrt(H), the scale rounded to the weights' dtype as
        transformers rounds it."""
        scale = torch.tensor(self.config.hidden_size ** 0.5, dtype=self.dtype)
        return self.embed(tokens) * scale

    def per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """tokens [B, T] and their scaled embeddings x [B, T, H] -> every layer's PLE vector [B, T, L, P]."""
        size = self.config.family_parts.per_layer_size
        if not size:
            return None
        shape = (*tokens.shape, self.config.num_layers, size)
        scale = torch.tensor(size ** 0.5, dtype=self.dtype)
        from_table = (self.per_layer_embed(tokens) * scale).view(shape)  # [B, T, L, P]
        projected = self.per_layer_norm((self.per_layer_projection(x) * self.config.hidden_size ** -0.5).view(shape))
        return (projected + from_table) * 2 ** -0.5

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        cache: KVCache | CacheBatch,
        attn_mask: torch.Tensor | None = None,  # [B, T, R+T] bool, see Transformer.forward
        hidden_layers: tuple[int, ...] = (),
        logits_at: torch.Tensor | slice | None = None,
        final_hidden: bool = False,
        head: nn.Module | None = None,
    ) -> ForwardOutput:
        new = tokens.shape[1]
        cache.check_room(new)
        windows = {"sliding_attention": self.config.family_parts.sliding_window, "full_attention": None}
        masks = {kind: attention_mask(positions, cache, attn_mask, windows[kind]) for kind in self.ropes}
        ropes = {kind: table.lookup(positions) for kind, table in self.ropes.items()}  # [B, 1, T, D/2] each
        cache.record_positions(positions)
        x = self.embed_scaled(tokens)  # [B, T, H]
        per_layer = self.per_layer_inputs(tokens, x)  # [B, T, L, P] or None
        if self.activation_dtype is not None:
            x = x.to(self.activation_dtype)
            per_layer = None if per_layer is None else per_layer.to(self.activation_dtype)
        hidden = {0: x} if 0 in hidden_layers else {}
        for index, layer in enumerate(self.layers):
            cos, sin = ropes[layer.kind]
            x = layer(x, cos, sin, cache, self.slots[index], masks[layer.kind],
                      None if per_layer is None else per_layer[:, :, index])
            if index + 1 in hidden_layers:
                hidden[index + 1] = x.to(self.dtype)
        cache.advance(new)
        head = self.lm_head if head is None else head
        normed = self.norm(x if final_hidden else pick_rows(x, logits_at))  # [B, T or T', H]
        logits = self.soft_cap(head(pick_rows(normed, logits_at) if final_hidden else normed).float())
        return ForwardOutput(logits, hidden, normed.to(self.dtype) if final_hidden else None)

    def soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """logits -> cap * tanh(logits / cap) where the config caps them."""
        cap = self.config.family_parts.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def gemma_frequencies(config: ModelConfig, kind: str) -> torch.Tensor:
    """[D/2] float32 inverse frequencies of a layer kind's rope. Full layers use "proportional" rope: the first
    fraction of the frequencies as ordinary rope over the whole head size, the rest zero (those pairs do not
    rotate), so the half-split rotation of rope.apply_rope applies unchanged."""
    parts = config.family_parts
    _, dim = layer_shape(config, kind)
    theta = parts.global_theta if kind == "full_attention" else parts.sliding_theta
    fraction = parts.global_rotary_fraction if kind == "full_attention" else 1.0
    rotating = int(fraction * dim // 2)
    inv_freq = torch.zeros(dim // 2, dtype=torch.float32)
    inv_freq[:rotating] = 1.0 / theta ** (torch.arange(0, 2 * rotating, 2, dtype=torch.float32) / dim)
    return inv_freq
