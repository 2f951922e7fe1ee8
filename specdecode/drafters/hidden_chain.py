"""A chain drafted step by step from a drafter's own hidden state: EAGLE-3 heads and MTP modules alike. Each
step takes a token from the logits it has (argmax when greedy, else a draw and the law it came from) and, while
the budget lasts, runs the drafter one position on to get the next logits and hidden state."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdecode.sampling import logits_to_probs, sample
from specdecode.spec_types import DraftProposal, Sequence

# (draft step i >= 1, the token drafted before it, the hidden state fed back) -> (logits [V], hidden [H])
Step = Callable[[int, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def draft_chain(seq: Sequence, budget: int, logits: torch.Tensor, hidden: torch.Tensor, step: Step,
                source: str) -> DraftProposal:
    """logits [V] (the target's vocabulary) and hidden [H] at the last committed position -> up to `budget`
    tokens. Greedy drafts are deterministic: verification must not see a q for them (it would bias sampling)."""
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    for i in range(budget):
        if seq.sampling.greedy:
            token = int(logits.argmax())
        else:
            q = logits_to_probs(logits, seq.sampling)  # [V]: the law the draft token is drawn from
            token = int(sample(q, seq.generator))
            rows.append(q)
        tokens.append(token)
        if i + 1 < budget:
            with torch.inference_mode():
                logits, hidden = step(i + 1, token, hidden)
    return DraftProposal.chain(tokens, torch.stack(rows) if rows else None, source)
