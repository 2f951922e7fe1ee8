"""Acceptance rules against slow loop references, edge cases, and the dispatcher.

The references take the random draws as inputs, drawn the way the implementation draws them (all K uniforms
first, then one sample), so results can be compared token for token; test_verify_distribution.py checks the
law itself.
"""

from __future__ import annotations

import pytest
import torch

from specdecode.acceptance.sampling import logits_to_probs
from specdecode.acceptance.tree import children_of
from specdecode.acceptance.verify import greedy_walk, sampling_walk, verify
from specdecode.config import SamplingParams
from specdecode.spec_types import DraftProposal, VerifyResult

pytestmark = pytest.mark.usefixtures("single_thread")


# The chain rules, through the one tree code path (a chain is the tree whose node i hangs off node i-1).
def _chain(draft: torch.Tensor, q: torch.Tensor | None = None) -> tuple[DraftProposal, list[list[int]]]:
    proposal = DraftProposal(draft, None, q)
    return proposal, children_of(proposal.parent_list())


def greedy_accept(draft: torch.Tensor, logits: torch.Tensor) -> VerifyResult:
    return greedy_walk(*_chain(draft), logits)


def rejection_sample(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator) -> VerifyResult:
    return sampling_walk(*_chain(draft, q), p, generator)


def match_sample(draft: torch.Tensor, p: torch.Tensor, generator) -> VerifyResult:
    return sampling_walk(*_chain(draft), p, generator)


def _reference_greedy(draft: list[int], logits: torch.Tensor) -> list[int]:
    rows = logits.tolist()
    committed = []
    for i, row in enumerate(rows):
        best = max(range(len(row)), key=lambda v: (row[v], -v))  # ties -> lowest id
        if i == len(draft) or draft[i] != best:
            return committed + [best]
        committed.append(draft[i])
    raise AssertionError("unreachable: the last row always commits")


def _reference_rejection(draft: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator) -> list[int]:
    uniforms = torch.rand(len(draft), generator=generator, dtype=torch.float32).tolist()
    p_rows, q_rows = p.tolist(), q.tolist()
    committed = []
    for i, x in enumerate(draft):
        ratio = p_rows[i][x] / q_rows[i][x] if q_rows[i][x] > 0 else float(p_rows[i][x] > 0)
        if uniforms[i] < min(1.0, ratio):
            committed.append(x)
            continue
        residual = [max(0.0, a - b) for a, b in zip(p_rows[i], q_rows[i])]
        if sum(residual) == 0:
            residual = p_rows[i]
        return committed + [int(torch.multinomial(torch.tensor(residual), 1, generator=generator))]
    return committed + [int(torch.multinomial(p[len(draft)], 1, generator=generator))]


def _reference_match(draft: list[int], p: torch.Tensor, generator: torch.Generator) -> list[int]:
    """Rejection sampling against a one-hot q, one token at a time (the draws line up with the vectorised rule)."""
    uniforms = torch.rand(len(draft), generator=generator).tolist()
    committed = []
    for i, x in enumerate(draft):
        if not uniforms[i] < float(p[i, x]):
            residual = p[i].clone()
            residual[x] = 0
            return committed + [int(torch.multinomial(residual, 1, generator=generator))]
        committed.append(x)
    return committed + [int(torch.multinomial(p[len(draft)], 1, generator=generator))]


def _random_case(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> draft tokens [K] drawn from q [K, V], target p [K+1, V]; K in 0..4, some rows p == q or one-hot."""
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(0, 5, (1,), generator=g))
    vocab = int(torch.randint(2, 9, (1,), generator=g))
    q = (2 * torch.randn(k, vocab, generator=g)).softmax(-1)  # [K, V]
    p = (2 * torch.randn(k + 1, vocab, generator=g)).softmax(-1)  # [K+1, V]
    if seed % 4 == 1 and k:
        p[0] = q[0]  # certain acceptance
    if seed % 4 == 2:
        p[0] = torch.nn.functional.one_hot(p[0].argmax(), vocab).float()  # zero target mass almost everywhere
    draft = torch.multinomial(q, 1, generator=g).squeeze(1) if k else torch.zeros(0, dtype=torch.long)  # [K]
    return draft, q, p


@pytest.mark.parametrize("seed", range(0, 200, 20))
def test_rejection_sample_matches_reference(seed: int) -> None:
    for case in range(seed, seed + 20):
        draft, q, p = _random_case(case)
        got = rejection_sample(draft, q, p, torch.Generator().manual_seed(case))
        assert got.tokens == _reference_rejection(draft.tolist(), q, p, torch.Generator().manual_seed(case))


def test_match_sample_and_greedy_match_reference() -> None:
    for case in range(200):
        draft, _, p = _random_case(case)
        got = match_sample(draft, p, torch.Generator().manual_seed(case))
        assert got.tokens == _reference_match(draft.tolist(), p, torch.Generator().manual_seed(case))
        # Half the cases draft the target's own argmax, so greedy acceptance runs deep too.
        greedy_draft = p[:-1].argmax(-1) if case % 2 else draft  # [K]
        assert greedy_accept(greedy_draft, p.log()).tokens == _reference_greedy(greedy_draft.tolist(), p.log())


def test_empty_draft_gives_one_target_token() -> None:
    p = torch.tensor([[0.0, 0.0, 1.0]])  # [1, V]
    empty = torch.zeros(0, dtype=torch.long)  # [0]
    for result in (
        greedy_accept(empty, p),
        rejection_sample(empty, torch.zeros(0, 3), p, torch.Generator().manual_seed(0)),
        match_sample(empty, p, torch.Generator().manual_seed(0)),
    ):
        assert result.num_accepted == 0 and result.tokens == [2]


def test_all_accepted_takes_bonus_from_last_row() -> None:
    draft = torch.tensor([1, 0])  # [K]
    p = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])  # [K+1, V]: drafts certain, bonus 2
    q = torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.2, 0.2]])  # [K, V]: p(x) >= q(x), so acceptance is certain
    for seed in range(20):
        assert rejection_sample(draft, q, p, torch.Generator().manual_seed(seed)).tokens == [1, 0, 2]
        assert match_sample(draft, p, torch.Generator().manual_seed(seed)).tokens == [1, 0, 2]
    assert greedy_accept(draft, p).tokens == [1, 0, 2]


def test_first_rejected_recovers_from_residual() -> None:
    draft = torch.tensor([0, 1])  # [K]
    p = torch.tensor([[0.0, 0.3, 0.7], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # [K+1, V]: p_0(x_0) = 0
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 1.0, 0.0]])  # [K, V]
    for seed in range(20):
        # residual max(0, p_0 - q_0) = [0, 0, 0.7]: only token 2 can be recovered
        result = rejection_sample(draft, q, p, torch.Generator().manual_seed(seed))
        assert result.num_accepted == 0 and result.tokens == [2]
        assert match_sample(draft, p, torch.Generator().manual_seed(seed)).path == []
    assert greedy_accept(draft, p).tokens == [2]


def test_all_zero_residual_falls_back_to_target_row() -> None:
    # Only reachable through rounding (p_i <= q_i everywhere), made explicit here with p_0 summing to 0.8.
    draft = torch.tensor([0])  # [K]
    p = torch.tensor([[0.0, 0.4, 0.4], [1.0, 0.0, 0.0]])  # [K+1, V]
    q = torch.tensor([[0.2, 0.4, 0.4]])  # [K, V]
    seen = {rejection_sample(draft, q, p, torch.Generator().manual_seed(s)).next_token for s in range(40)}
    assert seen == {1, 2}


def test_greedy_ties_follow_plain_greedy_decoding() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, 0.0]])  # [K+1, V]: tie at ids 1 and 2
    assert greedy_accept(torch.tensor([2]), logits).tokens == [1]
    assert greedy_accept(torch.tensor([1]), logits).tokens == [1, 0]


def test_same_seed_same_output() -> None:
    draft, q, p = _random_case(5)
    for rule in (lambda g: rejection_sample(draft, q, p, g), lambda g: match_sample(draft, p, g)):
        runs = [rule(torch.Generator().manual_seed(11)).tokens for _ in range(3)]
        assert runs[0] == runs[1] == runs[2]


def test_verify_dispatches_by_params_and_draft_kind() -> None:
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(3, 6, generator=g)  # [K+1, V]
    draft_logits = torch.randn(2, 6, generator=g)  # [K, V]
    params = SamplingParams(temperature=0.7, top_p=0.9)
    q = logits_to_probs(draft_logits, params)  # [K, V]
    draft = torch.multinomial(q, 1, generator=g).squeeze(1)  # [K]
    p = logits_to_probs(target_logits, params)  # [K+1, V]

    greedy = SamplingParams(temperature=0.0)
    sampled, deterministic = DraftProposal(draft, None, q), DraftProposal(draft)
    assert verify(sampled, target_logits, greedy, None).tokens == greedy_accept(draft, target_logits).tokens
    matched, rejected = [], []
    for seed in range(20):
        via_match = match_sample(draft, p, torch.Generator().manual_seed(seed)).tokens
        via_rejection = rejection_sample(draft, q, p, torch.Generator().manual_seed(seed)).tokens
        assert verify(deterministic, target_logits, params, torch.Generator().manual_seed(seed)).tokens == via_match
        assert verify(sampled, target_logits, params, torch.Generator().manual_seed(seed)).tokens == via_rejection
        matched.append(via_match)
        rejected.append(via_rejection)
    assert matched != rejected  # the two rules disagree on some seed, so the comparisons above discriminate


def test_verify_result_commits_accepted_then_next() -> None:
    result = VerifyResult(path=[0, 1], tokens=[4, 2, 7])
    assert result.num_accepted == 2 and result.next_token == 7 and result.kept_rows == [0, 1, 2]
    assert VerifyResult(path=[], tokens=[3]).kept_rows == [0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rules_run_on_cuda_with_a_cuda_generator() -> None:
    draft, q, p = _random_case(9)
    draft, q, p = draft.cuda(), q.cuda(), p.cuda()
    for rule in (lambda g: rejection_sample(draft, q, p, g), lambda g: match_sample(draft, p, g)):
        runs = [rule(torch.Generator(device="cuda").manual_seed(4)).tokens for _ in range(2)]
        assert runs[0] == runs[1] and 1 <= len(runs[0]) <= draft.numel() + 1
    assert greedy_accept(draft, p.log()).tokens == greedy_accept(draft.cpu(), p.log().cpu()).tokens
