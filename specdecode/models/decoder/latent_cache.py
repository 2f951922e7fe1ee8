"""The cache of multi-head latent attention (mla.py): per layer and token, the compressed latent (kv_lora_rank
values) and the one rotary key all heads share (qk_rope_head_dim), nothing per head. DeepSeek-V3 keeps 576 values
a token and layer where a grouped-query cache of its width would keep 2 x 128 heads x 192.

It is a KVCache whose `keys` hold those rows, [L, B, 1, S, C+R], and whose `values` hold nothing, [L, B, 1, S, 0]:
the attention reads its values from the latent part of the same rows. Everything the engine does with a KV cache
(chain truncation, a tree's compaction, the prefix cache's copies, batches of caches) then works on it unchanged,
at the latent's size.
"""

from __future__ import annotations

import torch

from specdecode.models.decoder.kv_cache import KVCache


class LatentCache(KVCache):
    def __init__(self, num_layers: int, batch_size: int, width: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """`width`: kv_lora_rank + qk_rope_head_dim, one token's row in one layer."""
        # KVCache's fields, allocated here: its constructor would allocate values as large as the keys.
        self.keys = torch.zeros(num_layers, batch_size, 1, capacity, width, dtype=dtype, device=device)  # [L, B, 1, S, W]
        self.values = torch.zeros(num_layers, batch_size, 1, capacity, 0, dtype=dtype, device=device)  # [L, B, 1, S, 0]
        self.positions = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)  # [B, S]
        self.lengths = [0] * batch_size
        self.capacity = capacity

    def layer_views(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each sequence's rows of `layer` [1, S, W], as keys and as values (what the fixed-order attention kernel
        reads: the values are the latent part of the same rows)."""
        rows = list(self.keys[layer].unbind(0))
        return rows, rows


def latent_bytes_per_token(layers: int, width: int, dtype: torch.dtype) -> int:
    """What one token costs in a latent cache of `layers` layers: its rows and its recorded position."""
    return layers * width * dtype.itemsize + 8
