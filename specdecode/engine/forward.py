"""The target forwards of a step: a proposal turned into the rows that verify it, and those rows run for one
sequence or for several in one forward (each with its own KV cache), with the hidden states their drafters read.

Rows of a verify forward: row 0 is the root (the last committed token, not yet in the KV cache), row i+1 is
proposed node i. A node's position is the root's plus its depth, so siblings share a position and attend to
their ancestors only. A chain is the tree whose node i hangs off node i-1; it needs no mask (causal order is
the ancestor order) and its rollback is a truncate.
"""

from __future__ import annotations

from time import perf_counter

import torch

from specdecode.acceptance.tree import ancestor_mask, check_parents, depths
from specdecode.drafters.base import Drafter
from specdecode.engine.load_budget import BatchDraftBudget
from specdecode.models.decoder.forward_inputs import ForwardInputs, forward_groups, padded_inputs
from specdecode.models.decoder.kv_cache import CacheBatch
from specdecode.models.decoder.transformer import Transformer
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput


def verify_inputs(root_token: int, proposal: DraftProposal, start: int, device: torch.device) -> ForwardInputs:
    """The one target forward that checks every node of `proposal`; `start` is the root's position."""
    root = torch.tensor([root_token], dtype=torch.long)  # [1]
    tokens = torch.cat([root, proposal.tokens.cpu()]).to(device).unsqueeze(0)  # [1, N+1]
    if proposal.is_chain:
        positions = torch.arange(start, start + proposal.size + 1, device=device).unsqueeze(0)  # [1, N+1]
        return ForwardInputs(tokens, positions, None)
    parents = proposal.parent_list()
    check_parents(parents)
    offsets = torch.tensor([0, *depths(parents)], device=device)  # [N+1]
    mask = ancestor_mask(parents).to(device).unsqueeze(0)  # [1, N+1, N+1]
    return ForwardInputs(tokens, (start + offsets).unsqueeze(0), mask)


def forward_rows(model: Transformer, seq: Sequence, inputs: ForwardInputs,
                 logits_at: slice | None = None) -> TargetOutput:
    """One target forward over one sequence's new rows, with the hidden states its drafter reads; batch dimension
    removed. `logits_at`: the rows that need logits (None: all)."""
    caps = seq.drafter.caps
    out = model(inputs.tokens, inputs.positions, seq.cache, attn_mask=inputs.mask, hidden_layers=caps.hidden_layers,
                logits_at=logits_at, final_hidden=caps.final_hidden)
    final = None if out.final_hidden is None else out.final_hidden[0]  # [T, H]
    return TargetOutput(out.logits[0], {k: v[0] for k, v in out.hidden.items()}, final)


def verify_forwards(model: Transformer, seqs: list[Sequence], inputs: list[ForwardInputs],
                    budget: BatchDraftBudget) -> list[TargetOutput]:
    """Each sequence's verify rows (`inputs`, [1, T_b] each) in as few forwards as their caches allow (usually
    one), each forward's cost taught to the load budget; -> each one's rows."""
    if len(seqs) == 1:
        return [forward_rows(model, seqs[0], inputs[0])]
    rows = [item.tokens.shape[1] for item in inputs]
    starts = [int(item.positions[0, 0]) for item in inputs]
    outputs: list[TargetOutput | None] = [None] * len(seqs)
    for group in forward_groups(starts, rows, [seq.cache.capacity for seq in seqs]):
        began = perf_counter()
        batch_out = _forward_batch(model, [seqs[b] for b in group], padded_inputs([inputs[b] for b in group]))
        budget.observe_forward(len(group) * max(rows[b] for b in group), perf_counter() - began)
        for b, out in zip(group, batch_out):
            outputs[b] = out.rows(list(range(rows[b])))
    return outputs


def _forward_batch(model: Transformer, seqs: list[Sequence], inputs: ForwardInputs) -> list[TargetOutput]:
    """One target forward over several sequences' padded rows (each with its own cache); -> each one's output
    over all T rows (padding included), with the hidden states any of their drafters reads."""
    hidden_layers = tuple(sorted({layer for seq in seqs for layer in seq.drafter.caps.hidden_layers}))
    final_hidden = any(seq.drafter.caps.final_hidden for seq in seqs)
    out = model(inputs.tokens, inputs.positions, CacheBatch([seq.cache for seq in seqs]), attn_mask=inputs.mask,
                hidden_layers=hidden_layers, final_hidden=final_hidden)
    return [TargetOutput(out.logits[b], {k: v[b] for k, v in out.hidden.items()},
                         None if out.final_hidden is None else out.final_hidden[b]) for b in range(len(seqs))]


def states_read(out: TargetOutput, drafter: Drafter) -> TargetOutput:
    """The hidden states `drafter` reads of `out`'s rows, copied (a step's rows are views of a forward whose logits
    are [T, V]: keeping a view would keep those), with no logits."""
    caps = drafter.caps
    hidden = {layer: out.hidden[layer].clone() for layer in caps.hidden_layers}  # [T', H] each
    final = out.final_hidden.clone() if caps.final_hidden else None  # [T', H]
    return TargetOutput(torch.empty(0), hidden, final)
