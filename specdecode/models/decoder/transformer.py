"""Our decoder for the Llama family (Llama 2/3, Mistral, Qwen2/2.5, Qwen3): one implementation, config-driven.

Built for speculative decoding: the caller supplies positions (tree nodes share them), an optional mask over the
new tokens, which positions need logits, and which hidden states to return (boundary ids, see DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.layers import DecoderLayer, RMSNorm
from specdecode.models.decoder.mtp import MTPModule
from specdecode.models.decoder.rope import RopeTable, attention_factor, inverse_frequencies
from specdecode.models.model_config import ModelConfig


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, T', V] float32, T' = len(logits_at) or T
    hidden: dict[int, torch.Tensor]  # boundary id -> [B, T, hidden]
    final_hidden: torch.Tensor | None = None  # [B, T, hidden] after the final norm, when asked for


class Transformer(nn.Module):
    mtp_feeds_back_normed = False  # a further MTP step is fed the module's output before its norm (decoder/mtp.py)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = self.build_layers(config)
        self.norm = self.build_norm(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # Multi-token-prediction modules the weights ship (plain decoding never runs them; drafters/mtp.py does).
        self.mtp = nn.ModuleList(MTPModule(config, self.build_mtp_block(config), self.mtp_feeds_back_normed)
                                 for _ in range(config.mtp_layers))
        self.rope: RopeTable | None = None
        self.rope_factors: torch.Tensor | None = None

    @staticmethod
    def build_layers(config: ModelConfig) -> nn.ModuleList:
        """The trunk's decoder layers (a hybrid trunk builds its own, families/qwen3_5/trunk.py)."""
        return nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))

    @staticmethod
    def build_norm(config: ModelConfig) -> nn.Module:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def build_mtp_block(config: ModelConfig) -> nn.Module:
        """The decoder block of one MTP module the weights ship (decoder/mtp.py): a layer of the trunk's kind."""
        return DecoderLayer(config)

    def finish_loading(self, rope_factors: torch.Tensor | None = None) -> None:
        """Once the weights (and so dtype and device) are final: tie a float output head to the embedding where
        the config says so (a quantized head has its own copy), and build the cos/sin table."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.embed.weight
        self.rope_factors = rope_factors  # [D/2] llama3 divisors from a GGUF file; kept so a saved copy has them
        weight = self.embed.weight
        inv_freq = inverse_frequencies(self.config, rope_factors)
        rope_dtype = self.layers[0].rope_dtype or weight.dtype  # fused layers take float32 cos/sin
        self.rope = RopeTable(inv_freq, self.config.max_position_embeddings, rope_dtype, weight.device,
                              attention_factor(self.config))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, capacity: int, batch_size: int = 1, rollback_rows: int = 1) -> KVCache:
        """`rollback_rows` matters to recurrent layers only (families/qwen3_5/trunk.py): a KV cache rolls back any way."""
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

    def begin_rows(self, cache: KVCache | CacheBatch, attn_mask: torch.Tensor | None, new: int) -> None:
        """Before a forward's layers run: nothing for a KV cache (a hybrid trunk tells its recurrent states each
        row's parent, families/qwen3_5/trunk.py)."""

    def cache_bytes(self, slots: int, rollback_rows: int = 1) -> int:
        """Memory a one-sequence cache of `slots` slots holds (`rollback_rows` matters to recurrent layers only)."""
        c = self.config
        return slots * (2 * c.num_layers * c.num_kv_heads * c.head_dim * self.dtype.itemsize + 8)

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
        # the output head to use instead of lm_head (a drafter's head over a reduced vocabulary, [Vd, H])
        head: nn.Module | None = None,
    ) -> ForwardOutput:
        new = tokens.shape[1]
        cache.check_room(new)
        mask = attention_mask(positions, cache, attn_mask, self.config.sliding_window)
        cos, sin = self.rope.lookup(positions)
        cache.record_positions(positions)
        self.begin_rows(cache, attn_mask, new)
        x = self.embed(tokens)  # [B, T, hidden]
        hidden = {0: x} if 0 in hidden_layers else {}
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, index, mask)  # fused layers keep it in float32
            if index + 1 in hidden_layers:
                hidden[index + 1] = x.to(self.dtype)
        cache.advance(new)
        head = self.lm_head if head is None else head
        if final_hidden:
            normed = self.norm(x)  # [B, T, hidden]
            return ForwardOutput(head(pick_rows(normed, logits_at)).float(), hidden, normed.to(self.dtype))
        logits = head(self.norm(pick_rows(x, logits_at))).float()  # [B, T', V] (or [B, T', Vd] from `head`)
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
