"""A drafter's reduced vocabulary: which ids it drafts over, its output head cut to those rows, and its logits
spread back over the target's vocabulary. On a CPU the output head is most of a small drafter's cost, and the
target verifies with its full head, so drafting over fewer tokens never changes the output."""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.transformer import Transformer
from specdecode.models.kernels.w4a8_linear import TILE_ROWS


def spread_to_vocab(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits over a draft vocabulary [..., Vd] (the target ids `ids` [Vd]) -> [..., V]: every other token gets
    -inf, so it is never drafted and the law drafts follow stays a law over the target's vocabulary."""
    full = logits.new_full((*logits.shape[:-1], vocab), float("-inf"))  # [..., V]
    full[..., ids] = logits
    return full


def frequent_ids(size: int, vocab: int, end_of_turn: frozenset[int]) -> torch.Tensor:
    """The `size` lowest ids (a byte-level BPE vocabulary numbers its merges most frequent first), a few more of
    them to make a multiple of TILE_ROWS with the end-of-turn tokens, and those, ascending -> [Vd] long: what
    `mtp_draft_vocab` drafts over and `train mtp` trains on."""
    lowest = min(size, vocab)

    def ends() -> list[int]:
        return sorted(t for t in end_of_turn if lowest <= t < vocab)

    # A head of whole tiles runs in the w4a8 kernel; else it falls back to int8.
    while (lowest + len(ends())) % TILE_ROWS and lowest < vocab:
        lowest += 1
    return torch.cat([torch.arange(lowest), torch.tensor(ends(), dtype=torch.long)])


def reduced_head(model: Transformer, ids: torch.Tensor, quant: str) -> nn.Module:
    """The output head's rows `ids` [Vd] as a layer of their own, in `quant` (--draft-quant)."""
    from specdecode.models.kernels.quantize_module import quantize_linears

    rows = model.output_rows(ids).to(model.dtype)  # [Vd, H], whatever the head's storage
    layer = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    layer.weight = nn.Parameter(rows, requires_grad=False)
    head = nn.Sequential(layer)  # a container, so quantize_linears can swap the layer in place
    quantize_linears(head, quant)
    return head
