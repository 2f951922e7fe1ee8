"""A hybrid trunk (Qwen 3.5 / 3.6 dense): Gated DeltaNet and gated full-attention layers (hybrid_layers.py) behind the
same interface as the Llama family's Transformer, so every drafter and the engine run over it unchanged.

What differs for them is the cache (cache.py): recurrent states next to the KV rows, kept per row for
rollback. Each forward tells the cache each new row's parent (from the tree mask), so a tree's nodes each run
from their parent's state.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.layers import ZeroCentredRMSNorm
from specdecode.models.decoder.moe import pack_routers
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.families.qwen3_5.cache import HybridCache
from specdecode.models.families.qwen3_5.layers import HybridDecoderLayer, layer_kinds
from specdecode.models.model_config import ModelConfig


class HybridTransformer(Transformer):
    mtp_feeds_back_normed = True  # vLLM's qwen3_5_mtp and transformers' MtpLayer feed back its post-norm output

    @staticmethod
    def build_layers(config: ModelConfig) -> nn.ModuleList:
        return nn.ModuleList(HybridDecoderLayer(config, kind, index) for kind, index in layer_kinds(config))

    @staticmethod
    def build_norm(config: ModelConfig) -> nn.Module:
        return ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)

    @staticmethod
    def build_mtp_block(config: ModelConfig) -> nn.Module:
        """Its MTP module's block is a gated full-attention layer of the trunk's kind."""
        return HybridDecoderLayer(config, "full_attention", 0)

    routers_invariant = False  # whether a MoE model's routers run on a row-invariant kernel (finish_loading)

    def finish_loading(self, rope_factors: torch.Tensor | None = None) -> None:
        super().finish_loading(rope_factors)
        self.routers_invariant = pack_routers(self)

    def new_cache(self, capacity: int, batch_size: int = 1, rollback_rows: int = 1) -> HybridCache:
        """`rollback_rows`: how many of its last rows the owner may roll back (cache.py)."""
        c = self.config
        shapes = [layer.mixer.state_shapes() for layer in self.layers if layer.kind == "linear_attention"]
        return HybridCache(len(c.attention_layers), batch_size, c.num_kv_heads, c.head_dim, capacity, self.dtype,
                           self.device, shapes, rollback_rows)

    def cache_bytes(self, slots: int, rollback_rows: int = 1) -> int:
        """Memory a one-sequence cache of `slots` slots holds at most: its current recurrent states, and during a
        step those after each of the `rollback_rows` rows of a verify forward (new_cache's window)."""
        c = self.config
        per_slot = 2 * len(c.attention_layers) * c.num_kv_heads * c.head_dim * self.dtype.itemsize + 8
        states = sum((layer.mixer.conv_channels * (layer.mixer.kernel - 1)) * self.dtype.itemsize
                     + 4 * layer.mixer.value_heads * layer.mixer.key_dim * layer.mixer.value_dim
                     for layer in self.layers if layer.kind == "linear_attention")
        return slots * per_slot + (rollback_rows + 1) * states  # the state before the rows, and one after each

    def begin_rows(self, cache: KVCache | CacheBatch, attn_mask: torch.Tensor | None, new: int) -> None:
        cache.record_rows(None if attn_mask is None else tree_parents(attn_mask, new))


def tree_parents(mask: torch.Tensor, new: int) -> torch.Tensor:
    """[B, T, R+T] ancestor mask -> each new row's parent among the new rows [B, T] (-1: the cached state). A row's
    parent is its last visible earlier row: ancestors come before descendants. Rows may not see cached slots
    selectively (R > 0 with holes): a recurrent state cannot skip tokens."""
    earlier = mask.shape[2] - new
    if earlier and not bool(mask[:, :, :earlier].all()):
        raise SpecDecodeError("a hybrid model cannot run rows that skip cached tokens (tree drafting over a "
                              "recurrent draft model's earlier levels); use a chain")
    own = mask[:, :, earlier:]  # [B, T, T]
    index = torch.arange(new, device=mask.device)
    before = own & (index.view(1, 1, new) < index.view(1, new, 1))  # [B, T, T] visible earlier rows
    return (before.long() * (index + 1).view(1, 1, new)).amax(-1) - 1  # [B, T]
