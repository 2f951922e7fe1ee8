"""Log-probabilities of emitted tokens under the target, computed in one place.

Raw log-probabilities: log_softmax of the target's own logits in float32, before temperature, top-k, top-p or
min-p (vLLM's default "raw_logprobs"), so they describe the model whatever the request samples with. They come
free from forwards the engine runs anyway: the prefill's last row for the first token, then the verify
forward's rows along the accepted path, where row i is the distribution committed token i was chosen from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the most likely ids and their log-probabilities, most likely first


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top: int) -> list[TokenLogprob]:
    """logits [T, V] (row i: the distribution token_ids[i] was chosen from) -> one TokenLogprob per token, each
    with its `top` most likely alternatives."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
    ids = torch.tensor(token_ids, device=logits.device)  # [T]
    chosen = log_probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1).tolist()  # [T]
    if top == 0:
        return [TokenLogprob(token, value) for token, value in zip(token_ids, chosen)]
    best_values, best_ids = log_probs.topk(min(top, log_probs.shape[-1]), dim=-1)  # [T, N] each
    return [TokenLogprob(token, value, tuple(zip(row_ids, row_values)))
            for token, value, row_ids, row_values in zip(token_ids, chosen, best_ids.tolist(), best_values.tolist())]
