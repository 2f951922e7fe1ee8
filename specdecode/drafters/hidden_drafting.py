"""A chain drafted step by step from a drafter's own hidden state: EAGLE-3 heads and MTP modules alike. Before
drafting, the drafter reads the target's rows of every position committed since (`read_pending`). Each step then
takes a token from the logits it has (argmax when greedy, else a draw: with the request's coupled noise at that
position, or from the generator with the law it came from) and, while the budget lasts, runs the drafter one
position on to get the next logits and hidden state. Several requests share each of these forwards in a batched
step: the catch-up padded per group of caches with room, then the chains still drafting together."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specdecode.acceptance.sampling import draw_drafts, logits_to_probs
from specdecode.models.decoder.forward_inputs import forward_groups
from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.spec_types import DraftProposal, Sequence

# (tokens [G, P], their hidden states [G, P, H], positions [G, P], one cache or a batch of them, each sequence's
# last real row [G, 1]) -> (logits there [G, 1, Vd], the hidden states to feed back [G, P, H])
CatchUp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KVCache | CacheBatch, torch.Tensor],
                   tuple[torch.Tensor, torch.Tensor]]
# (draft step i >= 1, which chains go on (indices into the batch), their tokens [F] long, their hidden states
# [F, H]) -> (logits [F, V], hidden [F, H])
BatchStep = Callable[[int, list[int], torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def draft_chains(seqs: list[Sequence], budgets: list[int], logits: list[torch.Tensor], hidden: list[torch.Tensor],
                 step: BatchStep, source: str) -> list[DraftProposal]:
    """Each sequence's logits [V] and hidden [H] at its last committed position -> up to its budget of tokens;
    the chains still drafting share each step. Greedy and coupled drafts are deterministic: verification must not
    see a q for them (it would bias sampling). Each sequence draws with its own generator or noise, so a chain is the
    same whichever others run beside it, given the same logits."""
    tokens: list[list[int]] = [[] for _ in seqs]
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]  # the laws sampled drafts were drawn from, [V] each
    logits, hidden = list(logits), list(hidden)
    for i in range(max(budgets, default=0)):
        going = []
        for b, seq in enumerate(seqs):
            if i >= budgets[b]:
                continue
            if seq.sampling.greedy:
                token = int(logits[b].argmax())
            else:
                q = logits_to_probs(logits[b], seq.sampling)  # [V]: the law the draft token is drawn from
                drawn, law = draw_drafts(q[None], seq, len(seq.tokens) + i)  # [1], [1, V] or None
                token = int(drawn[0])
                if law is not None:
                    rows[b].append(q)
            tokens[b].append(token)
            if i + 1 < budgets[b]:
                going.append(b)
        if not going:
            break
        with torch.inference_mode():
            fed = torch.tensor([tokens[b][-1] for b in going])  # [F]
            out_logits, out_hidden = step(i + 1, going, fed, torch.stack([hidden[b] for b in going]))
        for row, b in enumerate(going):
            logits[b], hidden[b] = out_logits[row], out_hidden[row]
    return [DraftProposal.chain(t, torch.stack(r) if r else None, source) for t, r in zip(tokens, rows)]


def read_pending(seqs: list[Sequence], states: list[Any], caches: list[KVCache], forward: CatchUp,
                 device: torch.device) -> None:
    """Feed the drafter every committed position it has not read. Each state holds `fed` (positions read),
    `pending` [R, H] (the target's rows of positions fed..fed+R-1) and gets `logits` [Vd] and `hidden` [H] at its
    last one; `caches` are the caches those rows go to. One forward per group of sequences whose caches have
    room for the longest (batched.forward_groups), each one's rows padded to that length: the padding comes after
    every real row, so no real row sees it, and its cache slots are dropped after."""
    reading = [b for b, state in enumerate(states) if state.pending.shape[0] > 0]
    if not reading:
        return
    width, dtype = states[reading[0]].pending.shape[1], states[reading[0]].pending.dtype
    starts, rows = [states[b].fed for b in reading], [states[b].pending.shape[0] for b in reading]
    for group in forward_groups(starts, rows, [caches[b].capacity for b in reading]):
        longest = max(rows[g] for g in group)
        tokens = torch.zeros(len(group), longest, dtype=torch.long)  # [G, P]
        positions = torch.empty(len(group), longest, dtype=torch.long)  # [G, P]
        hidden = torch.zeros(len(group), longest, width, dtype=dtype)  # [G, P, H]
        for row, g in enumerate(group):
            b, fed, own = reading[g], starts[g], rows[g]
            tokens[row, :own] = torch.tensor(seqs[b].tokens[fed + 1 : fed + 1 + own])  # each the token after
            positions[row] = torch.arange(fed, fed + longest).clamp(max=fed + own - 1)
            hidden[row, :own] = states[b].pending
        last = torch.tensor([[rows[g] - 1] for g in group], device=device)  # [G, 1]
        members = [caches[reading[g]] for g in group]
        with torch.inference_mode():
            logits, fed_back = forward(tokens.to(device), hidden.to(device), positions.to(device),
                                       members[0] if len(members) == 1 else CacheBatch(members), last)
        for row, g in enumerate(group):
            state, own = states[reading[g]], rows[g]
            state.fed += own
            caches[reading[g]].truncate(state.fed)
            state.pending = state.pending[:0]
            state.logits, state.hidden = logits[row, 0], fed_back[row, own - 1]  # [Vd], [H]
