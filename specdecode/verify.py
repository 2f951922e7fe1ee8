"""Acceptance math for one speculative step, as pure functions in paper notation. No model calls.

Notation (Leviathan et al. 2022, Chen et al. 2023): p is the target distribution, q the draft distribution,
x_1..x_K the draft tokens. Row i of p and q is the distribution for draft position i; p has one more row,
p_K, the target's distribution after all K drafts.

Terms (as in vLLM's rejection sampler):
- accepted tokens: the longest prefix of the drafts that the target keeps;
- recovered token: on the first rejection, the target's replacement for the rejected draft, drawn from
  norm(max(0, p_i - q_i)) (sampling) or argmax p_i (greedy);
- bonus token: when all K drafts are accepted, one more token drawn from p_K at no extra target forward.
Every step commits the accepted tokens plus exactly one recovered-or-bonus token (`next_token`), so a step
always makes progress and the output has exactly the target's distribution.

Random draws come from the `generator` passed in (a torch.Generator on the device of p, or None for torch's
global one): the same generator state gives the same result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.config import SamplingParams
from specdecode.sampling import logits_to_probs, sample


@dataclass
class VerifyResult:
    accepted: torch.Tensor  # [A] long, A <= K: the accepted prefix of the draft tokens
    next_token: int  # recovered token (after a rejection) or bonus token (all K accepted)

    @property
    def num_accepted(self) -> int:
        return self.accepted.numel()

    @property
    def tokens(self) -> list[int]:
        """What the step commits: accepted drafts, then the target's own token."""
        return self.accepted.tolist() + [self.next_token]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """mask [K] bool -> 0-d long: length of the all-True prefix, kept on device (no sync)."""
    return mask.long().cumprod(dim=0).sum()


def _result(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor) -> VerifyResult:
    # One host sync for both scalars: the caller needs them on the host to commit anyway.
    count, token = torch.stack([num_accepted, next_token]).tolist()
    return VerifyResult(accepted=draft_tokens[:count], next_token=token)


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> VerifyResult:
    """draft_tokens [K], target_logits [K+1, V]: keep drafts while they equal the target's argmax."""
    draft_tokens = draft_tokens.to(target_logits.device)  # [K]
    num_drafts = draft_tokens.numel()
    target_tokens = target_logits.argmax(dim=-1)  # [K+1]; ties -> lowest id, same as plain greedy decoding
    num_accepted = _leading_true(draft_tokens == target_tokens[:num_drafts])  # 0-d
    # At the first mismatch target_tokens holds the recovered token; past the last draft, the bonus token.
    return _result(draft_tokens, num_accepted, target_tokens[num_accepted])


def rejection_sample(
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> VerifyResult:
    """draft_tokens [K] drawn from q [K, V]; p [K+1, V]. Accept x_i with prob min(1, p_i(x_i) / q_i(x_i))."""
    draft_tokens = draft_tokens.to(p.device)  # [K]
    num_drafts = draft_tokens.numel()
    positions = torch.arange(num_drafts, device=p.device)  # [K]
    p_x = p[positions, draft_tokens]  # [K]
    q_x = q[positions, draft_tokens]  # [K]
    # All K uniforms at once, including those past the first rejection: unused draws cost nothing and keep
    # the generator's consumption independent of the outcome.
    uniforms = torch.rand(num_drafts, generator=generator, device=p.device, dtype=torch.float32)  # [K]
    # u < p/q written without the division, so q_x == 0 cannot produce inf/nan; strict '<' with u in [0, 1)
    # never accepts a token the target gives zero probability.
    accepted_mask = uniforms * q_x < p_x  # [K]
    num_accepted = _leading_true(accepted_mask)  # 0-d
    count = int(num_accepted)  # the row to draw from depends on it; the one sync before sampling

    if count == num_drafts:
        next_probs = p[num_drafts]  # [V] bonus distribution p_K
    else:
        residual = (p[count] - q[count]).clamp_min(0)  # [V]
        # The residual is all zero only when p_i <= q_i everywhere, i.e. p_i == q_i up to rounding; then
        # a rejection was a rounding artefact and p_i itself is the right distribution.
        next_probs = torch.where(residual.sum() > 0, residual, p[count])  # [V]
    next_token = sample(next_probs, generator)  # 0-d
    return VerifyResult(accepted=draft_tokens[:count], next_token=int(next_token))


def match_sample(draft_tokens: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """draft_tokens [K] from a deterministic drafter (q one-hot); p [K+1, V].

    Rejection sampling with one-hot q: accept x_i with probability p_i(x_i); at the first rejection draw the
    recovered token from p_i with x_i removed, renormalised. That is the law of sample-and-match (draw
    y_i ~ p_i, keep drafts while y_i == x_i, emit the first y_i that differs) with one uniform per draft and
    a single full-row draw per step instead of K+1 (a row costs about 3 ms at a 152k vocabulary on CPU).
    """
    draft_tokens = draft_tokens.to(p.device)  # [K]
    num_drafts = draft_tokens.numel()
    p_x = p[torch.arange(num_drafts, device=p.device), draft_tokens]  # [K]
    uniforms = torch.rand(num_drafts, generator=generator, device=p.device, dtype=torch.float32)  # [K]
    count = int(_leading_true(uniforms < p_x))  # strict '<': a token with p(x) == 0 is never accepted
    if count == num_drafts:
        next_probs = p[num_drafts]  # [V] bonus distribution p_K
    else:
        residual = p[count].clone()  # [V]
        residual[draft_tokens[count]] = 0  # norm(max(0, p - onehot(x))): p without the rejected draft
        # Empty only if p_i was one-hot at x_i up to rounding, when the rejection itself was rounding.
        next_probs = torch.where(residual.sum() > 0, residual, p[count])  # [V]
    next_token = sample(next_probs, generator)  # 0-d
    return VerifyResult(accepted=draft_tokens[:count], next_token=int(next_token))


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyResult:
    """draft_tokens [K], draft_probs [K, V] or None, target_logits [K+1, V] -> the step's VerifyResult.

    draft_probs must be the distribution the drafts were sampled from, via logits_to_probs with these same
    params. A drafter that picks tokens deterministically (argmax, n-gram lookup) must pass None, never the
    softmax of its logits: its tokens were not drawn from that q, and rejection sampling against it is biased.
    """
    if params.greedy:
        return greedy_accept(draft_tokens, target_logits)
    p = logits_to_probs(target_logits, params)  # [K+1, V]
    if draft_probs is None:
        return match_sample(draft_tokens, p, generator)
    return rejection_sample(draft_tokens, draft_probs, p, generator)
