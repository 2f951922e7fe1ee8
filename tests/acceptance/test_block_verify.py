"""Block verification (acceptance/block_verify.py): the rule equals a slow loop written from the paper's Algorithm
2, its output follows the target's law jointly over three positions (and the check catches a wrong rule), it
accepts at least as many tokens as the token-wise rule, and greedy decoding is unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from specdecode.acceptance.block_verify import block_decision, block_walk
from specdecode.acceptance.chi_square import chi_square
from specdecode.acceptance.sampling import logits_to_probs, sample
from specdecode.acceptance.verify import verify
from specdecode.config import SamplingParams
from specdecode.spec_types import DraftProposal, VerifyResult

V = 5
DRAFTS = 3  # a block of three: the weight ρ carries over two boundaries
TRIALS = 24_000
ALPHA = 1e-4
BOS = 0
PARAMS = SamplingParams(temperature=1.0)

pytestmark = pytest.mark.usefixtures("single_thread")


def reference(tokens: list[int], q: torch.Tensor | None, p: torch.Tensor, eta: list[float]) -> tuple[int, list]:
    """Algorithm 2 as written, one prefix at a time over explicit [V] rows (q None: one-hot at each draft)."""
    gamma = len(tokens)
    q_rows = q.tolist() if q is not None else [[float(y == x) for y in range(V)] for x in tokens]
    p_rows = p.tolist()
    rho, weights, tau = 1.0, [1.0], 0
    for i in range(1, gamma + 1):
        x = tokens[i - 1]
        rho = min(rho * p_rows[i - 1][x] / q_rows[i - 1][x], 1.0)
        weights.append(rho)
        if i < gamma:
            z = sum(max(rho * p_rows[i][y] - q_rows[i][y], 0.0) for y in range(V))
            h = z / (z + 1.0 - rho) if z + 1.0 - rho > 0 else 1.0
        else:
            h = rho
        if eta[i - 1] < h:
            tau = i
    if tau == gamma:
        return tau, p_rows[gamma]
    return tau, [max(weights[tau] * p_rows[tau][y] - q_rows[tau][y], 0.0) for y in range(V)]


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits by (position, previous token): [DRAFTS + 1, V, V] each, the draft correlated."""
    g = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(DRAFTS + 1, V, V, generator=g)
    return target, target + 1.5 * torch.randn(DRAFTS + 1, V, V, generator=g)


@pytest.mark.parametrize("drafts", ["sampled", "deterministic"])
def test_the_rule_equals_the_papers_loop(drafts):
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        gamma = int(torch.randint(1, 5, (1,), generator=g))
        p = torch.softmax(2 * torch.randn(gamma + 1, V, generator=g), dim=-1)  # [γ+1, V]
        q = torch.softmax(2 * torch.randn(gamma, V, generator=g), dim=-1) if drafts == "sampled" else None
        tokens = sample(q, g) if q is not None else torch.randint(0, V, (gamma,), generator=g)  # [γ]
        eta = torch.rand(gamma, generator=g)  # [γ]
        tau, law = block_decision(DraftProposal(tokens, None, q), p, eta)
        expected_tau, expected_law = reference(tokens.tolist(), q, p, eta.tolist())
        assert tau == expected_tau
        # Laws compared normalised: the deterministic residual is p without the draft, the reference's ρ p
        # without it, the same law.
        assert torch.allclose(law / law.sum(), torch.tensor(expected_law) / sum(expected_law), atol=1e-6)


def _emit_three(step, seed: int, deterministic: bool, n: int = TRIALS) -> tuple[torch.Tensor, torch.Tensor]:
    """n speculative steps of three drafts each (drawn from the draft table, or its argmax), by `step`
    (proposal, target logits [4, V], generator) -> (first three emitted tokens [n, 3], true joint [V, V, V])."""
    target_logits, draft_logits = _tables(seed)
    p_table = logits_to_probs(target_logits, PARAMS)  # [T, prev, V]
    q_table = logits_to_probs(draft_logits, PARAMS)  # [T, prev, V]
    g = torch.Generator().manual_seed(seed)
    emitted = []
    for _ in range(n):
        prev, tokens, q_rows = BOS, [], []
        for position in range(DRAFTS):
            row = q_table[position, prev]  # [V]
            prev = int(row.argmax()) if deterministic else int(sample(row, g))
            tokens.append(prev)
            q_rows.append(row)
        context = [BOS, *tokens]
        rows = target_logits[torch.arange(DRAFTS + 1), torch.tensor(context)]  # [4, V]
        proposal = DraftProposal(torch.tensor(tokens), None, None if deterministic else torch.stack(q_rows))
        out = step(proposal, rows, g).tokens
        while len(out) < 3:  # what later steps would emit: straight from the target's conditional
            out.append(int(sample(p_table[len(out), out[-1]], g)))
        emitted.append(out[:3])
    first = p_table[0, BOS].double()  # [V]
    joint = first[:, None, None] * p_table[1].double()[:, :, None] * p_table[2].double()[None, :, :]  # [V, V, V]
    return torch.tensor(emitted), joint


def _passes(emitted: torch.Tensor, joint: torch.Tensor) -> bool:
    counts = torch.bincount(emitted[:, 0] * V * V + emitted[:, 1] * V + emitted[:, 2], minlength=V**3)  # [V^3]
    return all(chi_square(c, pr, ALPHA).passed for c, pr in (
        (counts, joint.flatten()), (counts.view(V, V, V).sum((1, 2)), joint.sum((1, 2))),
        (counts.view(V, V, V).sum((0, 2)), joint.sum((0, 2))), (counts.view(V, V, V).sum((0, 1)), joint.sum((0, 1)))))


def block_step(proposal, target_logits, generator) -> VerifyResult:
    return verify(proposal, target_logits, PARAMS, generator, block=True)


@pytest.mark.parametrize("drafts", ["sampled", "deterministic"])
def test_block_verified_output_follows_the_target_law(drafts):
    emitted, joint = _emit_three(block_step, seed=11, deterministic=drafts == "deterministic")
    assert _passes(emitted, joint)


def _unweighted_residual(proposal, target_logits, generator) -> VerifyResult:
    """Wrong on purpose: the block rule's acceptance, but the token after a kept prefix drawn from
    max(p - q, 0), forgetting the prefix's weight ρ_τ."""
    p = logits_to_probs(target_logits, PARAMS)  # [γ+1, V]
    eta = torch.rand(proposal.size, generator=generator)  # [γ]
    tau, _ = block_decision(proposal, p, eta)
    law = p[tau] if tau == proposal.size else (p[tau] - proposal.probs[tau]).clamp_min(0)  # [V]
    tokens = proposal.tokens.tolist()
    return VerifyResult(list(range(tau)), tokens[:tau] + [int(sample(law, generator))])


def test_the_check_catches_a_block_rule_without_the_prefix_weight():
    emitted, joint = _emit_three(_unweighted_residual, seed=11, deterministic=False)
    assert not _passes(emitted, joint)


def test_block_verification_accepts_at_least_as_many_tokens_as_token_wise():
    """Theorem 2 of the paper, in expectation: the means over the same tables, within three standard errors."""
    accepted = {}
    for block in (True, False):
        def step(proposal, target_logits, generator, block=block):
            return verify(proposal, target_logits, PARAMS, generator, block=block)

        target_logits, draft_logits = _tables(5)
        q_table = logits_to_probs(draft_logits, PARAMS)
        g = torch.Generator().manual_seed(5)
        counts = []
        for _ in range(8000):
            prev, tokens, q_rows = BOS, [], []
            for position in range(DRAFTS):
                row = q_table[position, prev]
                prev = int(sample(row, g))
                tokens.append(prev)
                q_rows.append(row)
            rows = target_logits[torch.arange(DRAFTS + 1), torch.tensor([BOS, *tokens])]  # [4, V]
            counts.append(step(DraftProposal(torch.tensor(tokens), None, torch.stack(q_rows)), rows, g).num_accepted)
        accepted[block] = torch.tensor(counts, dtype=torch.float64)
    spread = math.sqrt(accepted[True].var() / 8000 + accepted[False].var() / 8000)
    assert accepted[True].mean() >= accepted[False].mean() - 3 * spread


def test_greedy_and_trees_are_verified_as_before():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, V, generator=g)  # [4, V]
    chain = DraftProposal(logits[:3].argmax(-1), None, None)
    greedy = SamplingParams()
    assert verify(chain, logits, greedy, None, block=True) == verify(chain, logits, greedy, None)
    tree = DraftProposal(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]), None)
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert verify(tree, logits, PARAMS, a, block=True) == verify(tree, logits, PARAMS, b)


def test_the_same_generator_state_gives_the_same_verdict():
    p = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(4)), dim=-1)  # [4, V]
    proposal = DraftProposal(torch.tensor([1, 2, 3]), None, None)
    a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    assert [block_walk(proposal, p, a) for _ in range(20)] == [block_walk(proposal, p, b) for _ in range(20)]
