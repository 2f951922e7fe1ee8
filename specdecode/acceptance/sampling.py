"""One logits -> probabilities transform shared by target and draft, the one sampler, and how drafters draw.

Target and draft must go through the same transform: rejection sampling is lossless only with respect to the
distribution the draft tokens were actually drawn from (q) and the one the user asked for (p). Under the coupled
rule a drafter draws with the request's noise instead (acceptance/noise.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.acceptance.noise import coupled_tokens
from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError
from specdecode.spec_types import Sequence


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probs [..., V] float32.

    Order as in transformers' warpers: temperature, top-k, top-p, min-p. Greedy (temperature 0) gives the
    one-hot of argmax (ties -> lowest index), so greedy verification can share code paths that expect probs.
    """
    logits = logits.float()  # [..., V]; bf16/fp16 model outputs would lose the small tail mass top-p sums over
    vocab_size = logits.shape[-1]
    if params.greedy:
        return F.one_hot(logits.argmax(dim=-1), vocab_size).float()  # [..., V]

    logits = logits / params.temperature  # [..., V]
    if 0 < params.top_k < vocab_size:
        # Threshold on the k-th value (not a scatter of topk indices) so ties at the boundary all survive,
        # exactly as transformers' TopKLogitsWarper does.
        kth_value = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth_value, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [..., V] each
        sorted_probs = sorted_logits.softmax(dim=-1)  # [..., V]
        # Mass strictly before each token: the shifted cumsum, not cumsum - prob, so the comparison uses the
        # very sums the cut is defined by. Keeping tokens with mass_before < top_p is the smallest prefix
        # reaching top_p, and the first token (mass_before 0) always stays.
        mass_before = F.pad(sorted_probs.cumsum(dim=-1)[..., :-1], (1, 0))  # [..., V]
        drop_sorted = mass_before >= params.top_p  # [..., V]
        # A top_p that rounds to 0 in float32 (5e-324, 1e-50) would drop every token, and softmax over nothing
        # is NaN: the most likely token always stays, as the definition (the smallest prefix) implies.
        drop_sorted[..., 0] = False
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)  # [..., V] back in vocab order
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        # prob_i / max_prob == exp(logit_i - max_logit): no softmax needed, and the max token always stays.
        max_logit = logits.amax(dim=-1, keepdim=True)  # [..., 1]
        relative = (logits - max_logit).exp()  # [..., V]
        logits = logits.masked_fill(relative < params.min_p, float("-inf"))
    return logits.softmax(dim=-1)  # [..., V]


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [..., V] (need not sum to 1) -> ids [...] long. Same generator state, same ids."""
    flat = probs.reshape(-1, probs.shape[-1])  # [R, V]; multinomial takes at most 2-D
    try:
        ids = torch.multinomial(flat, num_samples=1, generator=generator)  # [R, 1]
    except RuntimeError as error:
        # Our transforms never produce such a row from finite logits, so the model's output was NaN or inf:
        # corrupt weights or an overflowing dtype, not a bug of the request.
        raise SpecDecodeError(f"cannot sample: the model's probabilities hold NaN, inf or negative values "
                              f"({error}); its weights may be corrupt, or try --dtype float32") from None
    return ids.reshape(probs.shape[:-1])  # [...]


def draw_drafts(q: torch.Tensor, seq: Sequence, position: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sampling drafter's tokens for R consecutive positions from `position` (the index in seq.tokens the first
    one would take), from their laws q [R, V] (logits_to_probs with seq.sampling) -> (tokens [R] long, the laws to
    verify them against: q when drawn with the request's generator, None when drawn with its coupled noise, which
    makes them deterministic given the context, so verification must not see a q)."""
    if seq.noise is not None:
        return coupled_tokens(q, seq.noise.rows(list(range(position, position + q.shape[0])))), None
    return sample(q, seq.generator), q
