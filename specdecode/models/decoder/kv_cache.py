"""Preallocated per-layer K/V storage with per-sequence lengths.

Slots are written in order; rollback never copies for a chain (truncate just lowers the length, later writes
overwrite the stale slots) and does one gather for a tree (compact keeps the accepted path's slots).
"""

from __future__ import annotations

import torch

from specdecode.errors import SpecDecodeError


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, D]
        # The position each slot was written for; tree nodes share positions, so slot index != position.
        self.positions = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)  # [B, S]
        self.lengths = [0] * batch_size
        self.capacity = capacity

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    @property
    def nbytes(self) -> int:
        """Memory the cache holds, allocated for its whole capacity."""
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    def check_room(self, new_tokens: int) -> None:
        if max(self.lengths) + new_tokens > self.capacity:
            raise SpecDecodeError(
                f"context full: {max(self.lengths)} cached + {new_tokens} new tokens exceed the cache "
                f"capacity of {self.capacity} tokens"
            )

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [B, Hkv, T, D] after each sequence's current length (not yet advanced).

        Returns the layer's keys and values [B, Hkv, S_used, D] covering every slot a query may see.
        """
        new = keys.shape[2]
        for b, start in enumerate(self.lengths):
            self.keys[layer, b, :, start : start + new] = keys[b]
            self.values[layer, b, :, start : start + new] = values[b]
        return self.read(layer, new)

    def read(self, layer: int, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, S_used, D] another layer wrote this forward for its `new` tokens (what a
        Gemma 4 KV-shared layer attends to)."""
        used = max(self.lengths) + new
        return self.keys[layer, :, :, :used], self.values[layer, :, :, :used]

    def end_state(self) -> None:
        """What a cache holds beyond its KV rows after the last one (a hybrid cache's recurrent states); a KV
        cache holds nothing more, so any prefix of its rows can be reused."""

    def fill(self, keys: torch.Tensor, values: torch.Tensor, end_state: None = None) -> None:
        """An empty single-sequence cache takes n rows written elsewhere for positions 0..n-1 (keys and values
        [L, Hkv, n, D], e.g. from the prefix cache); `end_state`: end_state() after them, none here."""
        rows = keys.shape[2]
        self.keys[:, 0, :, :rows] = keys
        self.values[:, 0, :, :rows] = values
        self.positions[0, :rows] = torch.arange(rows, device=self.positions.device)
        self.lengths[0] = rows

    def layer_views(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each sequence's keys and values of `layer`, [Hkv, S, D] views (what a fused layer writes and reads)."""
        return list(self.keys[layer].unbind(0)), list(self.values[layer].unbind(0))

    def key_positions(self, used: int) -> torch.Tensor:
        """[B, used] the position each of the first `used` slots was written for."""
        return self.positions[:, :used]

    def record_positions(self, positions: torch.Tensor) -> None:
        """positions [B, T] of the tokens about to be written."""
        new = positions.shape[1]
        for b, start in enumerate(self.lengths):
            self.positions[b, start : start + new] = positions[b]

    def advance(self, new_tokens: int) -> None:
        self.lengths = [n + new_tokens for n in self.lengths]

    def truncate(self, length: int, batch_index: int | None = None) -> None:
        """Chain rollback: forget every slot at or after `length` (O(1): the data stays, to be overwritten)."""
        targets = range(self.batch_size) if batch_index is None else (batch_index,)
        for b in targets:  # check every target first, so a failed call changes nothing
            if not 0 <= length <= self.lengths[b]:
                raise ValueError(f"cannot truncate sequence {b} from {self.lengths[b]} to {length} slots")
        for b in targets:
            self.lengths[b] = length

    def keep(self, start: int, rows: list[int], batch_index: int = 0) -> None:
        """After a verify forward written from slot `start`: keep its `rows` (ascending), drop the rest.

        A chain's accepted rows are 0..A, a prefix: that is a truncate. A tree's path skips rows: one compact.
        """
        if rows[-1] == len(rows) - 1:
            self.truncate(start + len(rows), batch_index)
        else:
            self.compact(torch.tensor(rows, device=self.positions.device) + start, start, batch_index)

    def compact(self, keep_slots: torch.Tensor, start: int, batch_index: int = 0) -> None:
        """Tree rollback: keep slots [0, start) plus `keep_slots` [N] (ascending, all >= start), packed after start.

        One gather per tensor moves the accepted path's K/V into consecutive slots.
        """
        n = keep_slots.numel()
        dest = slice(start, start + n)
        self.keys[:, batch_index, :, dest] = self.keys[:, batch_index, :, keep_slots]
        self.values[:, batch_index, :, dest] = self.values[:, batch_index, :, keep_slots]
        self.positions[batch_index, dest] = self.positions[batch_index, keep_slots]
        self.lengths[batch_index] = start + n


class CacheBatch:
    """Several sequences' own caches (batch 1 each, any capacities) seen as one batch by a target forward.

    A batched step joins whatever caches its sequences hold, so each keeps a cache sized to its own request and
    nothing is copied between steps. The fused w4a8 layers read each sequence's tensors in place; the PyTorch
    layers get the slots a forward may see stacked into one padded copy (`write`).
    """

    def __init__(self, caches: list[KVCache]):
        if any(cache.batch_size != 1 for cache in caches):
            raise ValueError("a cache batch joins single-sequence caches")
        self.caches = caches

    @property
    def lengths(self) -> list[int]:
        return [cache.lengths[0] for cache in self.caches]

    @property
    def batch_size(self) -> int:
        return len(self.caches)

    def check_room(self, new_tokens: int) -> None:
        for cache in self.caches:
            cache.check_room(new_tokens)

    def layer_views(self, layer: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [cache.keys[layer, 0] for cache in self.caches], [cache.values[layer, 0] for cache in self.caches]

    def key_positions(self, used: int) -> torch.Tensor:
        """[B, used]; slots past a sequence's capacity read as position 0 (no query ever sees them)."""
        rows = [cache.positions[0, :used] for cache in self.caches]
        return torch.stack([torch.nn.functional.pad(row, (0, used - row.numel())) for row in rows])

    def record_positions(self, positions: torch.Tensor) -> None:
        """positions [B, T] of the tokens about to be written."""
        for b, cache in enumerate(self.caches):
            cache.record_positions(positions[b : b + 1])

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As KVCache.write; the slots a query may see come back stacked [B, Hkv, S_used, D] (zeros past a
        sequence's own slots, which the attention mask hides)."""
        new = keys.shape[2]
        used = max(self.lengths) + new
        seen_keys, seen_values = [], []
        for b, cache in enumerate(self.caches):
            k, v = cache.write(layer, keys[b : b + 1], values[b : b + 1])  # [1, Hkv, S_b, D] each
            pad = (0, 0, 0, used - k.shape[2])
            seen_keys.append(torch.nn.functional.pad(k, pad))
            seen_values.append(torch.nn.functional.pad(v, pad))
        return torch.cat(seen_keys), torch.cat(seen_values)

    def read(self, layer: int, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As KVCache.read, stacked and padded as `write`."""
        used = max(self.lengths) + new
        parts = [cache.read(layer, new) for cache in self.caches]  # [1, Hkv, S_b, D] each
        pads = [(0, 0, 0, used - k.shape[2]) for k, _ in parts]
        return (torch.cat([torch.nn.functional.pad(k, pad) for (k, _), pad in zip(parts, pads)]),
                torch.cat([torch.nn.functional.pad(v, pad) for (_, v), pad in zip(parts, pads)]))

    def advance(self, new_tokens: int) -> None:
        for cache in self.caches:
            cache.advance(new_tokens)

    # A hybrid trunk's recurrent states (cache.py's HybridCache): stacked for the forward, each
    # sequence's rows handed back to its own cache.
    @property
    def row_parents(self) -> torch.Tensor | None:
        parents = [cache.row_parents for cache in self.caches]
        return None if parents[0] is None else torch.cat(parents)

    def record_rows(self, parents: torch.Tensor | None) -> None:
        for b, cache in enumerate(self.caches):
            cache.record_rows(None if parents is None else parents[b : b + 1])

    def recurrent_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [cache.recurrent_state(layer) for cache in self.caches]
        return torch.cat([conv for conv, _ in parts]), torch.cat([ssm for _, ssm in parts])

    def rows_kept_from(self, new: int) -> int:
        return min(cache.rows_kept_from(new) for cache in self.caches)

    def write_recurrent(self, layer: int, conv_rows: torch.Tensor, ssm_rows: list[torch.Tensor],
                        every_row: bool) -> None:
        for b, cache in enumerate(self.caches):
            cache.write_recurrent(layer, conv_rows[b : b + 1], [rows[b : b + 1] for rows in ssm_rows], every_row)
