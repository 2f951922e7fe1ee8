"""The cache of a hybrid trunk (Qwen 3.5): keys and values for its full-attention layers, and for each Gated DeltaNet
layer a convolution state [K-1, C] and a recurrent state [Hv, dk, dv] per sequence.

A KV cache rolls back by forgetting slots; a recurrent state cannot be un-applied. So the cache keeps the states
after each of the last `rollback_rows` rows it was given (gated_deltanet.py's sequential form computes them
anyway: keeping one is keeping a reference), and rollback picks the one after the last kept row:

- `truncate(n)`: the state after row n-1, which must be among those kept (a chain: the target's accepted
  drafts, a draft model back to the committed tokens);
- `keep(start, rows)`: a verify forward's accepted path, a chain's prefix or a tree's path: the state after its
  last row, which for a tree node was computed from its parent's (gated_deltanet.py), so it is exactly the state
  of a clean run over the accepted tokens.

`rollback_rows` is what the cache's owner may roll back: 1 for plain decoding (only the current state is held), a
verify forward's rows for a target, a drafting step's for a draft model. A long prompt read in the chunked form
leaves only its final state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.kv_cache import KVCache


@dataclass
class RecurrentState:
    """One sequence's states after some row: per Gated DeltaNet layer, [K-1, C] and [Hv, dk, dv] (float32)."""

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.conv) + sum(t.nbytes for t in self.ssm)


class HybridCache(KVCache):
    def __init__(self, attention_layers: int, batch_size: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, state_shapes: list[tuple[tuple, tuple]],
                 rollback_rows: int = 1):
        super().__init__(attention_layers, batch_size, num_kv_heads, head_dim, capacity, dtype, device)
        self.rollback_rows = max(1, rollback_rows)
        empty = RecurrentState([torch.zeros(conv, dtype=dtype, device=device) for conv, _ in state_shapes],
                               [torch.zeros(ssm, dtype=torch.float32, device=device) for _, ssm in state_shapes])
        # Per sequence: cached length -> the states after that many rows (the current one included).
        self._states: list[dict[int, RecurrentState]] = [{0: empty} for _ in range(batch_size)]
        # Per sequence: the last forward's kept rows (first row index, states), for keep() of a tree path.
        self._rows: list[tuple[int, list[RecurrentState]] | None] = [None] * batch_size
        self.row_parents: torch.Tensor | None = None  # [B, T] during a forward (recurrent layers read it)
        # layer -> the rows being written: conv states [B, T', K-1, C], T' recurrent states [B, Hv, dk, dv], and
        # whether every row's came out
        self._pending: dict[int, tuple[torch.Tensor, list[torch.Tensor], bool]] = {}

    @property
    def nbytes(self) -> int:
        held = {id(s): s.nbytes for states in self._states for s in states.values()}
        return super().nbytes + sum(held.values())

    def state(self, batch_index: int = 0) -> RecurrentState:
        """The states after every cached row of sequence `batch_index`."""
        return self._states[batch_index][self.lengths[batch_index]]

    # What a forward's recurrent layers call (gated_deltanet.py).
    def record_rows(self, parents: torch.Tensor | None) -> None:
        """parents [B, T] of the rows about to be written (-1: the cached state), or None for a chain."""
        self.row_parents = parents

    def recurrent_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s current states of every sequence: [B, K-1, C] and [B, Hv, dk, dv]."""
        if self.batch_size == 1:  # views, not copies: this runs once per layer per decoded token
            state = self.state(0)
            return state.conv[layer].unsqueeze(0), state.ssm[layer].unsqueeze(0)
        states = [self.state(b) for b in range(self.batch_size)]
        return torch.stack([s.conv[layer] for s in states]), torch.stack([s.ssm[layer] for s in states])

    def rows_kept_from(self, new: int) -> int:
        """The first of `new` rows whose states will be kept (a tree's every row: they are each other's parents)."""
        return 0 if self.row_parents is not None else max(0, new - self.rollback_rows)

    def write_recurrent(self, layer: int, conv_rows: torch.Tensor, ssm_rows: list[torch.Tensor],
                        every_row: bool) -> None:
        """The states after the forward's rows (from rows_kept_from on), [B, T', K-1, C] and T' of [B, Hv, dk, dv];
        `every_row` False when only the last row's came out (the chunked form)."""
        self._pending[layer] = (conv_rows, ssm_rows, every_row)

    def advance(self, new_tokens: int) -> None:
        if self._pending:
            self._take_rows(new_tokens)
        super().advance(new_tokens)
        self.row_parents = None

    def _take_rows(self, new: int) -> None:
        layers = range(len(self._pending))
        kept = len(self._pending[0][1])
        for b, start in enumerate(self.lengths):
            rows = [RecurrentState([self._pending[i][0][b, r] for i in layers], [self._pending[i][1][r][b] for i in layers])
                    for r in range(kept)]
            first = new - kept
            self._rows[b] = (first, rows) if self._pending[0][2] else None
            chain = self._chain_length(b, new)
            states = self._states[b]
            for r, row in enumerate(rows):
                if first + r < chain:  # rows of the chain from the cached state: their lengths are known
                    states[start + first + r + 1] = row
            states[start + new] = rows[-1]
            self._trim(b, start + new, len(rows))  # a batch pads its rows beyond this sequence's window
        self._pending = {}

    def _chain_length(self, b: int, new: int) -> int:
        """How many leading rows of sequence b's forward are a chain (row i's parent is row i-1)."""
        if self.row_parents is None:
            return new
        parents = self.row_parents[b].tolist()
        return next((i for i, p in enumerate(parents) if p != i - 1), new)

    def _trim(self, b: int, length: int, rows: int = 0) -> None:
        """Keep the states of the last max(rollback_rows, rows) lengths up to `length` and the one before them;
        forget later ones."""
        states = self._states[b]
        keep = sorted(n for n in states if n <= length)[-max(self.rollback_rows, rows) - 1:]
        self._states[b] = {n: states[n] for n in keep}

    # Rollback.
    def truncate(self, length: int, batch_index: int | None = None) -> None:
        targets = range(self.batch_size) if batch_index is None else (batch_index,)
        for b in targets:
            if length not in self._states[b] and 0 <= length <= self.lengths[b]:
                raise SpecDecodeError(f"cannot roll sequence {b}'s recurrent state back to {length} tokens: it "
                                      f"keeps the states of its last {self.rollback_rows} rows only")
        super().truncate(length, batch_index)
        for b in targets:
            self._trim(b, length)

    def keep(self, start: int, rows: list[int], batch_index: int = 0) -> None:
        last = self._rows[batch_index]
        if last is None or not last[0] <= rows[-1] < last[0] + len(last[1]):
            raise SpecDecodeError("a hybrid cache keeps rows of its last forward only when it computed each row's "
                                  "state (a forward of more rows than its rollback window, or a chunked one)")
        state = last[1][rows[-1] - last[0]]
        self._rows[batch_index] = None  # the rejected rows' states go now, not at the next forward
        super().keep(start, rows, batch_index)  # a chain's truncate finds that state kept at its length
        self._states[batch_index][start + len(rows)] = state
        self._trim(batch_index, start + len(rows))

    def end_state(self) -> RecurrentState:
        """The recurrent states after sequence 0's last row: a prefix of its rows is reusable only with them."""
        return self.state(0)

    def fill(self, keys: torch.Tensor, values: torch.Tensor, end_state: RecurrentState | None = None) -> None:
        """As KVCache.fill, with the recurrent states after those rows (a prefix cache entry's)."""
        if end_state is None:
            raise SpecDecodeError("a hybrid cache resumes only from saved recurrent states")
        super().fill(keys, values)
        self._states[0] = {self.lengths[0]: end_state}
