"""Block verification (Sun, Mendlovic, Leviathan et al., ICLR 2025, arXiv:2403.10444): a drafted chain judged as
a block, not token by token. Lossless like the token-wise rule (its Theorem 1), and never accepts fewer tokens in
expectation (its Theorem 2), with no extra forward: only the residual masses below, over rows the verify forward
already computed.

Notation as the paper's (Algorithm 2), positions 1-indexed: X_1..X_γ the drafted chain, q_i the law X_i was drawn
from, p_i the target's law at position i (p_{γ+1} the bonus row), η_1..η_γ uniform draws.

    ρ_0 = 1,  ρ_i = min(ρ_{i-1} p_i(X_i) / q_i(X_i), 1)                      the prefix's weight
    Z_{i+1} = Σ_x max(ρ_i p_{i+1}(x) - q_{i+1}(x), 0)                       residual mass after i tokens
    h_i = Z_{i+1} / (Z_{i+1} + 1 - ρ_i)  for i < γ,   h_γ = ρ_γ            the chance to keep X_1..X_i
    τ = the largest i with η_i < h_i (0 if none)                             every prefix judged, not the first
    next token ~ p_{γ+1} if τ = γ, else ~ norm(max(ρ_τ p_{τ+1} - q_{τ+1}, 0))

Unlike the token-wise rule, a prefix can be kept although one of its own tokens alone would have been rejected:
the weight ρ carries what earlier tokens gained (p > q) to later ones. A deterministic draft is a one-hot q; then
Z_{i+1} = ρ_i (1 - p_{i+1}(X_{i+1})) and the residual is p_{τ+1} without X_{τ+1}, so no [γ, V] one-hot is built.
Greedy decoding never comes here: its rule is the argmax walk. Trees keep recursive rejection sampling over
siblings (verify.py): the block rule is defined for one chain, and a tree's siblings are drawn independently.

Random draws: γ uniforms (one per node, whatever the outcome), then one draw of the next token, as the token-wise
rule consumes them.
"""

from __future__ import annotations

import torch

from specdecode.acceptance.sampling import sample
from specdecode.spec_types import DraftProposal, VerifyResult


def block_walk(proposal: DraftProposal, p: torch.Tensor, generator: torch.Generator | None) -> VerifyResult:
    """A chain `proposal` of γ nodes (probs: the q each was drawn from, [γ, V], or None for deterministic drafts)
    and the target's p [γ+1, V] -> the step's VerifyResult by the block rule."""
    eta = torch.rand(proposal.size, generator=generator, device=p.device, dtype=torch.float32)  # [γ] η_1..η_γ
    tau, next_law = block_decision(proposal, p, eta)
    host_tokens = proposal.tokens.tolist()
    next_token = int(sample(next_law, generator))
    return VerifyResult(list(range(tau)), host_tokens[:tau] + [next_token], proposal.source)


def block_decision(proposal: DraftProposal, p: torch.Tensor, eta: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The rule without its draws: η [γ] -> (τ, the law of the token after X_1..X_τ [V], need not sum to 1)."""
    gamma, device = proposal.size, p.device
    tokens = proposal.tokens.to(device)  # [γ] X_1..X_γ
    positions = torch.arange(gamma, device=device)  # [γ]
    p_x = p[positions, tokens]  # [γ] p_i(X_i)
    q = proposal.probs  # [γ, V] or None (one-hot at X_i)
    q_x = q[positions, tokens].float() if q is not None else torch.ones_like(p_x)  # [γ] q_i(X_i)
    host_eta, host_px, host_qx = torch.stack([eta.to(p_x.dtype), p_x, q_x]).tolist()  # one sync

    rho = [1.0]  # ρ_0..ρ_γ
    for px, qx in zip(host_px, host_qx):
        rho.append(min(rho[-1] * px / qx, 1.0) if qx > 0 else 0.0)
    residual_mass = _residual_masses(rho, p, q, host_px)  # Z_2..Z_γ, one per prefix i < γ
    tau = 0
    for i in range(1, gamma + 1):
        if i == gamma:
            h = rho[gamma]
        else:
            z = residual_mass[i - 1]
            denominator = z + 1.0 - rho[i]
            h = z / denominator if denominator > 0 else 1.0
        if host_eta[i - 1] < h:
            tau = i
    return tau, _next_law(tau, gamma, rho, p, q, proposal.tokens.tolist())


def _residual_masses(rho: list[float], p: torch.Tensor, q: torch.Tensor | None, p_x: list[float]) -> list[float]:
    """Z_{i+1} for i = 1..γ-1: Σ_x max(ρ_i p_{i+1}(x) - q_{i+1}(x), 0), with p [γ+1, V] and q [γ, V] (None: one-hot
    at the drafted tokens, whose mass is ρ_i (1 - p_{i+1}(X_{i+1})) since ρ_i p <= 1)."""
    gamma = len(rho) - 1
    if gamma < 2:
        return []
    if q is None:
        return [rho[i] * (1.0 - p_x[i]) for i in range(1, gamma)]
    weights = torch.tensor(rho[1:gamma], dtype=p.dtype, device=p.device).unsqueeze(1)  # [γ-1, 1] ρ_1..ρ_{γ-1}
    masses = (weights * p[1:gamma] - q[1:gamma].to(p.dtype)).clamp_min(0).sum(dim=-1)  # [γ-1]
    return masses.tolist()


def _next_law(tau: int, gamma: int, rho: list[float], p: torch.Tensor, q: torch.Tensor | None,
              tokens: list[int]) -> torch.Tensor:
    """The law of the token after the kept prefix X_1..X_τ -> [V], need not sum to 1."""
    if tau == gamma:
        return p[gamma]  # the bonus row
    if q is None:  # one-hot q: p_{τ+1} without the drafted token
        residual = p[tau].clone()  # [V]
        residual[tokens[tau]] = 0
    else:
        residual = (rho[tau] * p[tau] - q[tau].to(p.dtype)).clamp_min(0)  # [V]
    # All zero only when ρ_τ p_{τ+1} <= q_{τ+1} everywhere, so h_τ was 0 and τ could not have stopped here but by
    # rounding: then p_{τ+1} itself is the right law.
    return torch.where(residual.sum() > 0, residual, p[tau])
