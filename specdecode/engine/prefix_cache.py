"""The target's KV cache of ended requests, kept so that a later prompt starting with the same tokens reads only
what is new (llama.cpp's `cache_prompt`, vLLM's automatic prefix caching).

A chat client sends the whole conversation every turn, and an agent the same long instructions every call:
without this, each request reads all of it again (about a second per 150 tokens on 2 cores). An entry keeps a
request's keys and values for every token that went through the target (prompt and answer) and, when its
drafter reads the target's hidden states, those of the same rows, so a later drafter starts from the inputs a
whole read would give it; a request whose drafter reads states takes only entries that kept those states. A
drafter with a KV cache of its own over the tokens (a draft model) has its rows kept too, and a later request's
drafter starts from them (Drafter.token_caches).

A hybrid target (Qwen 3.5) also needs the recurrent states after the reused rows, and those exist only where
an entry ends (families/qwen3_5/cache.py), so its entries are reused whole or not at all: a chat's next turn,
which begins with the whole of the last one, still hits. A recurrent draft model's rows are not kept (a cache's
end_state() says whether its rows are reusable in part).

What a hit changes in the output: nothing on a w4a8 target, whose kernels give a row the same bits whatever rows
share its forward (tests/drafters/test_drafter_contract.py); on others the reused rows were computed in another forward
shape, so tokens may differ at near-ties, as with chunked prefill. Entries are dropped least recently used first
to stay within the byte budget; an entry whose tokens begin a newer one (the same chat, a turn later) is
dropped for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.drafters import capabilities
from specdecode.drafters.base import DrafterCaps
from specdecode.engine.request import Request
from specdecode.errors import SpecDecodeError
from specdecode.spec_types import TargetOutput


@dataclass(eq=False)
class PrefixEntry:
    tokens: torch.Tensor  # [n] long: the token each cached slot was written for, at position = slot
    keys: torch.Tensor  # [L, Hkv, n, D]
    values: torch.Tensor  # [L, Hkv, n, D]
    hidden: dict[int, torch.Tensor]  # boundary id -> [n, H]: the states the request's drafter read, every row
    final_hidden: torch.Tensor | None  # [n, H] or None when that drafter read none
    # drafter name -> its own keys and values [L', Hkv', m, D'] of the first m <= n tokens (a draft model's)
    drafter_rows: dict[str, tuple[torch.Tensor, torch.Tensor]]
    # what the cache holds beyond its rows after all n of them (a hybrid target's recurrent states: KVCache.end_state)
    recurrent: object | None = None

    def usable_length(self, common: int) -> int:
        """Of `common` leading tokens shared with a prompt, how many can be reused (a hybrid entry: all or none)."""
        return common if self.recurrent is None or common == self.tokens.numel() else 0

    @property
    def nbytes(self) -> int:
        states = [*self.hidden.values(), *([] if self.final_hidden is None else [self.final_hidden])]
        states += [part for pair in self.drafter_rows.values() for part in pair]
        recurrent = 0 if self.recurrent is None else self.recurrent.nbytes
        return self.tokens.nbytes + self.keys.nbytes + self.values.nbytes + sum(s.nbytes for s in states) + recurrent

    def has_states(self, layers, final: bool) -> bool:
        """Whether the entry kept the hidden states of these boundary ids (and the final ones, if `final`)."""
        return set(layers) <= self.hidden.keys() and (not final or self.final_hidden is not None)

    def reusable_rows(self, caps: DrafterCaps) -> int:
        """Rows a request whose drafter has `caps` may take: all, or none if it lacks the states it reads."""
        return self.tokens.numel() if self.has_states(caps.hidden_layers, caps.final_hidden) else 0


class PrefixCache:
    def __init__(self, capacity_bytes: int):
        if type(capacity_bytes) is not int or capacity_bytes < 1:
            raise SpecDecodeError(f"the prefix cache's budget must be a positive number of bytes, got "
                                  f"{capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._entries: list[PrefixEntry] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries)

    @property
    def entries(self) -> int:
        return len(self._entries)

    def restore(self, seq: Request) -> TargetOutput | None:
        """Write the longest cached beginning of a new request's prompt into its (empty) cache, and hand its
        drafter the rows of its own caches (`seq.reused_drafter_rows`); -> what a prefill of those rows would
        have given the drafter (their hidden states; no logits), or None for no hit. The prompt's last token is
        always left to read: its logits sample the first token."""
        caps = seq.drafter.caps
        entry, length = self._longest_match(seq.tokens[: seq.prompt_len - 1], caps)
        if entry is None:
            return None
        self._entries.remove(entry)
        self._entries.append(entry)
        seq.cache.fill(entry.keys[:, :, :length], entry.values[:, :, :length], entry.recurrent)
        seq.reused_drafter_rows = {name: (keys[:, :, :length], values[:, :, :length])
                                   for name, (keys, values) in entry.drafter_rows.items()}
        hidden = {layer: entry.hidden[layer][:length] for layer in caps.hidden_layers}  # [length, H] each
        final = entry.final_hidden[:length] if caps.final_hidden else None  # [length, H]
        return TargetOutput(torch.empty(0), hidden, final)

    def _longest_match(self, tokens: list[int], caps: DrafterCaps) -> tuple[PrefixEntry | None, int]:
        query = torch.tensor(tokens, dtype=torch.long)  # [P - 1]
        best, best_length = None, 0
        for entry in self._entries:
            length = entry.usable_length(_common_prefix(entry.tokens, query, entry.reusable_rows(caps)))
            if length > best_length:
                best, best_length = entry, length
        return best, best_length

    def store(self, seq: Request) -> None:
        """Keep what `seq`'s cache holds (every token but the last, which the target has not read) with the
        hidden states its drafter read of those rows (`seq.read_states`)."""
        length = seq.cache.lengths[0]
        if length != len(seq.tokens) - 1:  # a step failed between its forward and its commit: rows not kept
            return
        tokens = torch.tensor(seq.tokens[:length], dtype=torch.long)  # [n]
        states = TargetOutput.joined(seq.read_states) if seq.read_states else TargetOutput(torch.empty(0))
        keys, values = seq.cache.keys[:, 0, :, :length], seq.cache.values[:, 0, :, :length]  # [L, Hkv, n, D] each
        drafter_rows = {name: (cache.keys[:, 0, :, :rows].clone(), cache.values[:, 0, :, :rows].clone())
                        for name, cache in capabilities.token_caches(seq.drafter, seq).items()
                        if (rows := min(cache.lengths[0], length)) > 0 and cache.end_state() is None}
        new = PrefixEntry(tokens, keys.clone(), values.clone(), states.hidden, states.final_hidden, drafter_rows,
                          seq.cache.end_state())
        for entry in list(self._entries):
            common = _common_prefix(entry.tokens, tokens, entry.tokens.numel())
            if common == length and entry.has_states(new.hidden, new.final_hidden is not None):
                return  # an entry already holds all of it
            if common == entry.tokens.numel() and new.has_states(entry.hidden, entry.final_hidden is not None):
                self._entries.remove(entry)  # the new one holds all of that one
        if new.nbytes > self.capacity_bytes:
            return
        while self.nbytes + new.nbytes > self.capacity_bytes:
            self._entries.pop(0)
        self._entries.append(new)


def _common_prefix(cached: torch.Tensor, query: torch.Tensor, limit: int) -> int:
    """How many leading tokens of `cached` [n] and `query` [m] agree, counting at most `limit`."""
    length = min(limit, cached.numel(), query.numel())
    differ = (cached[:length] != query[:length]).nonzero()  # [d, 1]
    return length if differ.numel() == 0 else int(differ[0, 0])
