"""A drafter's reduced vocabulary: which ids it drafts over, its output head cut to those rows, and its logits
spread back over the target's vocabulary. On a CPU the output head is most of a small drafter's cost, and the
target verifies with its full head, so drafting over fewer tokens never changes the output."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
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


COUNTS_FILE = "token_counts.json"  # written by `specdecode train vocab` (training/vocab_counts.py)


def read_counts(folder: Path, vocab: int) -> torch.Tensor | None:
    """The target's emitted-token counts [V] long saved in `folder`, or None when there are none (or they were
    counted for another vocabulary size)."""
    path = folder / COUNTS_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if record["vocab_size"] != vocab:
            return None
        counts = torch.zeros(vocab, dtype=torch.long)  # [V]
        ids = torch.tensor([int(i) for i in record["counts"]], dtype=torch.long)
        counts[ids] = torch.tensor(list(record["counts"].values()), dtype=torch.long)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as error:
        raise SpecDecodeError(f"{path} is not a token count file ({error}); run `specdecode train vocab` "
                              "again") from None
    return counts


def counted_ids(counts: torch.Tensor, size: int, end_of_turn: frozenset[int]) -> torch.Tensor:
    """The `size` ids the target emitted most (counts [V]; ties and ids never seen in id order, lowest first), a
    few more of them to make a multiple of TILE_ROWS with the end-of-turn tokens, and those, ascending -> [Vd]."""
    vocab = counts.numel()
    order = torch.sort(-counts, stable=True).indices  # [V] most emitted first, then by id
    ends = sorted(t for t in end_of_turn if t < vocab)
    chosen = order[~torch.isin(order, torch.tensor(ends, dtype=torch.long))]  # [V - E]
    take = min(size, chosen.numel())
    while (take + len(ends)) % TILE_ROWS and take < chosen.numel():
        take += 1
    return torch.cat([chosen[:take], torch.tensor(ends, dtype=torch.long)]).sort().values


def reduced_head(model: Transformer, ids: torch.Tensor, quant: str) -> nn.Module:
    """The output head's rows `ids` [Vd] as a layer of their own, in `quant` (--draft-quant)."""
    from specdecode.models.kernels.quantize_module import quantize_linears

    rows = model.output_rows(ids).to(model.dtype)  # [Vd, H], whatever the head's storage
    layer = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    layer.weight = nn.Parameter(rows, requires_grad=False)
    head = nn.Sequential(layer)  # a container, so quantize_linears can swap the layer in place
    quantize_linears(head, quant)
    return head
