"""A chain drafted step by step from a drafter's own hidden state: EAGLE-3 heads and MTP modules alike. Each
step takes a token from the logits it has (argmax when greedy, else a draw and the law it came from) and, while
the budget lasts, runs the drafter one position on to get the next logits and hidden state. Several requests'
chains can share each step's forward (`draft_chains`): the ones still drafting go through it together."""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdecode.sampling import logits_to_probs, sample
from specdecode.spec_types import DraftProposal, Sequence

# (draft step i >= 1, the token drafted before it, the hidden state fed back) -> (logits [V], hidden [H])
Step = Callable[[int, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (draft step i >= 1, which chains go on (indices into the batch), their tokens [F] long, their hidden states
# [F, H]) -> (logits [F, V], hidden [F, H])
BatchStep = Callable[[int, list[int], torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def draft_chain(seq: Sequence, budget: int, logits: torch.Tensor, hidden: torch.Tensor, step: Step,
                source: str) -> DraftProposal:
    """logits [V] (the target's vocabulary) and hidden [H] at the last committed position -> up to `budget`
    tokens."""

    def one(index: int, chains: list[int], tokens: torch.Tensor, hiddens: torch.Tensor):
        logits, fed_back = step(index, int(tokens[0]), hiddens[0])
        return logits.unsqueeze(0), fed_back.unsqueeze(0)

    return draft_chains([seq], [budget], [logits], [hidden], one, source)[0]


def draft_chains(seqs: list[Sequence], budgets: list[int], logits: list[torch.Tensor], hidden: list[torch.Tensor],
                 step: BatchStep, source: str) -> list[DraftProposal]:
    """Each sequence's logits [V] and hidden [H] at its last committed position -> up to its budget of tokens;
    the chains still drafting share each step. Greedy drafts are deterministic: verification must not see a q for
    them (it would bias sampling). Each sequence draws from its own generator, so a chain is the same whichever
    others run beside it, given the same logits."""
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
                token = int(sample(q, seq.generator))
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
