"""Acceptance math for one speculative step, chains and trees alike, as pure functions. No model calls.

Notation (Leviathan et al. 2022, Chen et al. 2023; Miao et al. 2023 for trees): p is the target distribution,
q the draft distribution. Row 0 of the target's logits is the root (the last committed token), row i+1 is
proposed node i; a node's p is the row of its parent, the distribution its token competes in.

Terms (as in vLLM's rejection sampler):
- accepted tokens: the nodes on the root-to-leaf path the target keeps;
- recovered token: after every child of the path's last node is rejected, the target's own token, drawn
  from what is left of p (sampling) or argmax p (greedy);
- bonus token: when the path ends at a node with no children, one more token drawn from that node's p.
Every step commits the accepted tokens plus exactly one recovered-or-bonus token (`next_token`), so a step
always makes progress and the output has exactly the target's distribution.

Sampling over a tree is recursive rejection sampling over siblings (SpecInfer's multi-step speculative
sampling): at a node with residual r (first p), the next child x drawn from q is accepted with probability
min(1, r(x) / q(x)); on rejection r becomes norm(max(r - q, 0)) for the next sibling. Deterministic children
(argmax, top-k, n-gram matches) take the same rule with a one-hot q: accept x with probability r(x), else
remove x from r and renormalise. A chain is the tree with one child per node, on the same code path.

Coupled sampling (the `coupled` rule, acceptance/noise.py): each row's randomness is fixed by the request's seed and
the position the row samples, as race weights w. The target's token at a row is its Gumbel-max token argmax p w, and
the walk is the greedy one over those tokens: the child equal to it wins, else the target's token is the step's
next token. Each emitted token is the target's own Gumbel-max sample given the accepted prefix, so the output is
plain decoding's at the same seed, token for token, whatever was drafted. A drafter that samples draws its tokens
with the same weights (argmax q w): no q is needed to verify them.

Random draws (token-wise and block rules) come from the `generator` passed in: N uniforms per step (one per node,
drawn whatever the outcome, so consumption does not depend on it), then one draw of the next token. Same state,
same result; but what a seed draws then depends on what was drafted.
"""

from __future__ import annotations

import torch

from specdecode.acceptance.block_verify import block_walk
from specdecode.acceptance.relaxed import Relaxed
from specdecode.acceptance.sampling import logits_to_probs, sample
from specdecode.acceptance.tree import children_of
from specdecode.config import SamplingParams
from specdecode.spec_types import DraftProposal, VerifyResult


def verify(proposal: DraftProposal, target_logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None, relaxed: Relaxed | None = None, block: bool = False,
           noise: torch.Tensor | None = None) -> VerifyResult:
    """proposal of N nodes, target_logits [N+1, V] -> the step's VerifyResult.

    `noise` [N+1, V]: the race weights of each row's position (noise.PositionNoise.for_proposal): sampling is then
    coupled, and the generator is not used. Otherwise proposal.probs must be the distributions the nodes were
    sampled from, via logits_to_probs with these same params. A drafter that picks tokens deterministically must
    pass None, never the softmax of its logits: its tokens were not drawn from that q, and rejection sampling
    against it is biased. `relaxed` (opt-in, lossy, relaxed.py) also keeps the drafts its rule keeps. `block`: a
    sampled chain is judged by block verification (block_verify.py) instead of token by token; trees, greedy
    decoding, coupled sampling and relaxed rules keep their own rule.
    """
    children = children_of(proposal.parent_list())
    if params.greedy:
        relaxed_keeps = None if relaxed is None else _relaxed_keeps(
            relaxed, proposal, torch.softmax(target_logits.float(), dim=-1))  # p [N+1, V] only when asked
        return greedy_walk(proposal, children, target_logits, relaxed_keeps)
    p = logits_to_probs(target_logits, params)  # [N+1, V]
    if noise is not None:
        return coupled_walk(proposal, children, p, noise, _relaxed_keeps(relaxed, proposal, p))
    if block and relaxed is None and proposal.is_chain and proposal.size > 0:
        return block_walk(proposal, p, generator)
    return sampling_walk(proposal, children, p, generator, _relaxed_keeps(relaxed, proposal, p))


def greedy_walk(proposal: DraftProposal, children: list[list[int]], scores: torch.Tensor,
                relaxed_keeps: list[bool] | None = None) -> VerifyResult:
    """From the root, step to the first child equal to the target's token there, the argmax of its row of `scores`
    [N+1, V] (the logits when greedy, p w when coupled), while one is (else, with relaxed acceptance, to the
    first child its rule keeps)."""
    best = scores.argmax(dim=-1)  # [N+1]; ties -> lowest id, as in plain decoding
    host = torch.cat([best, proposal.tokens.to(best.device)]).tolist()  # one sync for both
    best, tokens = host[: len(children)], host[len(children):]
    row, path = 0, []
    while (node := _greedy_child(children[row], tokens, best[row], relaxed_keeps)) is not None:
        path.append(node)
        row = node + 1
    return VerifyResult(path, [tokens[i] for i in path] + [best[row]], proposal.source)


def coupled_walk(proposal: DraftProposal, children: list[list[int]], p: torch.Tensor, noise: torch.Tensor,
                 relaxed_keeps: list[bool] | None = None) -> VerifyResult:
    """The coupled rule: p [N+1, V] and each row's race weights noise [N+1, V]; a row's token is its Gumbel-max token,
    the argmax of p w, and the walk is the greedy one over those tokens."""
    return greedy_walk(proposal, children, p * noise.to(p.device), relaxed_keeps)  # [N+1, V] race scores


def _greedy_child(siblings: list[int], tokens: list[int], best: int, relaxed_keeps: list[bool] | None
                  ) -> int | None:
    exact = next((c for c in siblings if tokens[c] == best), None)
    if exact is not None or relaxed_keeps is None:
        return exact
    return next((c for c in siblings if relaxed_keeps[c]), None)


def _relaxed_keeps(relaxed: Relaxed | None, proposal: DraftProposal, p: torch.Tensor) -> list[bool] | None:
    """Which nodes the relaxed rule keeps (None without one); p [N+1, V]."""
    if relaxed is None or proposal.size == 0:
        return None
    parent_rows = torch.tensor(proposal.parent_list(), dtype=torch.long, device=p.device) + 1  # [N]
    return relaxed.keeps(p, parent_rows, proposal.tokens.to(p.device)).tolist()


def sampling_walk(proposal: DraftProposal, children: list[list[int]], p: torch.Tensor,
                  generator: torch.Generator | None, relaxed_keeps: list[bool] | None = None) -> VerifyResult:
    """p [N+1, V] target probabilities per row; siblings are tried in index order (with relaxed acceptance,
    the first sibling its rule keeps wins before the exact rule is asked)."""
    num_nodes, device = proposal.size, p.device
    tokens = proposal.tokens.to(device)  # [N]
    parent_rows = torch.tensor(proposal.parent_list(), dtype=torch.long, device=device) + 1  # [N]
    uniforms = torch.rand(num_nodes, generator=generator, device=device, dtype=torch.float32)  # [N]
    p_x = p[parent_rows, tokens]  # [N] each node's target probability where it competes
    q = proposal.probs  # [N, V] or None
    q_x = q[torch.arange(num_nodes, device=device), tokens] if q is not None else torch.ones_like(p_x)  # [N]
    u, px, qx = torch.stack([uniforms, p_x, q_x.float()]).tolist()  # one sync
    host_tokens = proposal.tokens.tolist()

    row, path, residual = 0, [], None
    while children[row]:
        relaxed_node = next((c for c in children[row] if relaxed_keeps[c]), None) if relaxed_keeps else None
        if relaxed_node is not None:
            node, residual = relaxed_node, None
        elif q is None:
            node, residual = _one_hot_siblings(children[row], host_tokens, u, px, p[row])
        else:
            node, residual = _drawn_siblings(children[row], host_tokens, u, px, qx, p[row], q)
        if node is None:
            break
        path.append(node)
        row = node + 1
    next_probs = p[row] if residual is None else residual  # [V], need not sum to 1
    next_token = int(sample(next_probs, generator))
    return VerifyResult(path, [host_tokens[i] for i in path] + [next_token], proposal.source)


def _one_hot_siblings(siblings: list[int], tokens: list[int], u: list[float], px: list[float],
                      p_row: torch.Tensor) -> tuple[int | None, torch.Tensor | None]:
    """Deterministic siblings: accept x with probability r(x), r = p without the rejected tokens, renormalised.

    -> (the accepted node, None) or (None, the unnormalised residual to draw the recovered token from).
    """
    removed: list[int] = []
    removed_mass = 0.0
    for node in siblings:
        token = tokens[node]
        if token in removed:  # already rejected: zero mass left, never accepted
            continue
        # u < p(x) / (1 - removed mass), without the division; strict '<' never accepts a zero-mass token.
        if u[node] * max(1.0 - removed_mass, 0.0) < px[node]:
            return node, None
        removed.append(token)
        removed_mass += px[node]
    residual = p_row.clone()  # [V]
    residual[torch.tensor(removed, device=p_row.device)] = 0
    # Empty only if p was one-hot on rejected tokens up to rounding, when the rejection itself was rounding.
    return None, torch.where(residual.sum() > 0, residual, p_row)


def _drawn_siblings(siblings: list[int], tokens: list[int], u: list[float], px: list[float], qx: list[float],
                    p_row: torch.Tensor, q: torch.Tensor) -> tuple[int | None, torch.Tensor | None]:
    """Siblings each drawn from its own row of q: accept x with min(1, r(x) / q(x)), else r = norm(max(r - q, 0)).

    -> (the accepted node, None) or (None, the unnormalised residual to draw the recovered token from).
    """
    residual = p_row  # [V]: r for the first sibling is p itself (normalised)
    for index, node in enumerate(siblings):
        r_x = px[node] if index == 0 else float(residual[tokens[node]] / residual.sum())
        # u < r/q without the division, so q(x) == 0 cannot produce inf/nan.
        if u[node] * qx[node] < r_x:
            return node, None
        remaining = (residual / residual.sum() - q[node]).clamp_min(0) if index else (p_row - q[node]).clamp_min(0)
        # All zero only when r <= q everywhere, i.e. r == q up to rounding; then the rejection was a rounding
        # artefact and r itself is the right distribution.
        residual = torch.where(remaining.sum() > 0, remaining, residual)
    return None, residual
