"""Speculative sampling is lossless: the emitted tokens follow the target's distribution, jointly over positions.

Setup: a vocabulary of V=6 and a toy target and draft whose next-token logits depend on the position and the
previous token (tables [position, previous token, V]), so both the acceptance at position 2 and the bonus token
see a distribution conditioned on what was drafted before. Each trial runs one speculative step with K = 0, 1
or 2 drafts (cycled, so the bonus token lands at position 1, 2 or 3) and records the first two emitted tokens.
When the step emits only one token, the second comes straight from the target conditional: a later step's first
token, whose law the first-token check covers. Truth: p(y1) p(y2 | y1), from the tables through
logits_to_probs (checked against a slow reference in test_sampling.py).

Coupled sampling: each trial is a seed, and each position's noise is that seed's row there (acceptance/noise.py).
Sampled drafts are the draft's Gumbel-max tokens with the same rows, and a second token left for a later step is
the target's Gumbel-max token at position 1 with that trial's row.

Check: Pearson chi-square on the V*V joint and on each marginal, against the alpha = 1e-4 critical value.
Seeds are fixed, so a run is deterministic; the small alpha keeps the test from becoming flaky if torch ever
changes its random streams. The same check must reject deliberately wrong rules (the teeth tests).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from specdecode.acceptance.chi_square import chi_square
from specdecode.acceptance.noise import coupled_tokens, position_key, race_weights
from specdecode.acceptance.sampling import logits_to_probs, sample
from specdecode.acceptance.tree import children_of
from specdecode.acceptance.verify import greedy_walk, verify
from specdecode.config import SamplingParams
from specdecode.spec_types import DraftProposal, VerifyResult

V = 6
NUM_TRIALS = 20_000
MAX_DRAFTS = 2
BOS = 0  # the "previous token" of position 0
ALPHA = 1e-4

SETTINGS = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=1.0, top_k=3),
    "top_p": SamplingParams(temperature=1.2, top_p=0.9),
    "min_p": SamplingParams(temperature=1.0, min_p=0.15),
}

# (draft tokens [K], their laws [K, V] or None, target logits [K+1, V], params, generator, race weights [K+1, V] or
# None when not coupled) -> the step's verdict
StepFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, SamplingParams, torch.Generator,
                   torch.Tensor | None], VerifyResult]


pytestmark = pytest.mark.usefixtures("single_thread")


def chain_verify(draft_tokens, draft_probs, target_logits, params, generator, noise=None) -> VerifyResult:
    """verify() on a chain of drafts (tests/acceptance/test_tree_verify.py covers trees), coupled when given noise."""
    return verify(DraftProposal(draft_tokens, None, draft_probs), target_logits, params, generator, noise=noise)


def _tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    positions = MAX_DRAFTS + 1  # rows for output positions 0..K (the last one is the bonus row)
    target = 1.5 * torch.randn(positions, V, V, generator=g)  # [T, prev, V]
    # Correlated with the target, as a real draft model is: acceptances and rejections both happen often.
    draft = target + 1.5 * torch.randn(positions, V, V, generator=g)  # [T, prev, V]
    return target, draft


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """counts [C], probs [C] -> (statistic, critical value at ALPHA). An outcome of probability 0 gives inf
    (e.g. a token outside top-k was emitted: no sampling noise explains that)."""
    test = chi_square(counts, probs, ALPHA)
    return (math.inf, 0.0) if test.impossible else (test.statistic, test.critical)


def _emit_two_tokens(
    step: StepFn, params: SamplingParams, deterministic: bool, pass_probs: bool, seed: int, n: int = NUM_TRIALS,
    coupled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run n speculative steps; return (first two emitted tokens [N, 2], true joint [V, V])."""
    target_logits, draft_logits = _tables(seed)  # [T, prev, V] each
    p_table = logits_to_probs(target_logits, params)  # [T, prev, V]
    q_table = logits_to_probs(draft_logits, params)  # [T, prev, V]
    g = torch.Generator().manual_seed(seed)
    weights = _trial_noise(seed, n) if coupled else None  # [N, K_max+1, V]: trial i's rows at positions 0..K_max

    # Drafts for all trials at once, position by position, each conditioned on the previous draft.
    prev = torch.full((n,), BOS)  # [N]
    drafts = []
    for position in range(MAX_DRAFTS):
        q_rows = q_table[position, prev]  # [N, V]
        if deterministic:
            token = q_rows.argmax(dim=-1)  # [N]
        else:
            token = sample(q_rows, g) if weights is None else coupled_tokens(q_rows, weights[:, position])  # [N]
        drafts.append(token)
        prev = token
    draft_tokens = torch.stack(drafts, dim=1)  # [N, K_max]
    context = torch.cat([torch.full((n, 1), BOS), draft_tokens], dim=1)  # [N, K_max+1] previous token per row
    rows = torch.arange(MAX_DRAFTS + 1)  # [K_max+1]
    target_rows = target_logits[rows, context]  # [N, K_max+1, V]
    draft_rows = q_table[rows[:-1], context[:, :-1]]  # [N, K_max, V]

    outputs = []
    with torch.inference_mode():
        for i in range(n):
            k = i % (MAX_DRAFTS + 1)
            probs = draft_rows[i, :k] if pass_probs else None
            noise = None if weights is None else weights[i, : k + 1]  # [k+1, V]
            tokens = step(draft_tokens[i, :k], probs, target_rows[i, : k + 1], params, g, noise).tokens
            outputs.append(tokens[:2] if len(tokens) > 1 else [tokens[0], -1])  # -1: left for a later step
    emitted = torch.tensor(outputs)  # [N, 2]
    later = emitted[:, 1] < 0  # [N]
    later_probs = p_table[1, emitted[later, 0]]  # [L, V]
    emitted[later, 1] = sample(later_probs, g) if weights is None else coupled_tokens(later_probs, weights[later, 1])

    joint = p_table[0, BOS].double()[:, None] * p_table[1].double()  # [V, V]: p(y1) p(y2 | y1)
    return emitted, joint


def _trial_noise(seed: int, n: int) -> torch.Tensor:
    """-> race weights [N, K_max+1, V]: trial i is request seed seed * n + i, at positions 0..K_max."""
    keys = torch.tensor([position_key(seed * n + i, position) for i in range(n) for position in range(MAX_DRAFTS + 1)])
    return race_weights(keys, V).view(n, MAX_DRAFTS + 1, V)


def _assert_matches(emitted: torch.Tensor, joint: torch.Tensor) -> None:
    """emitted [N, 2], joint [V, V]: chi-square on the joint and on both marginals, each at alpha = 1e-4."""
    pair_counts = torch.bincount(emitted[:, 0] * V + emitted[:, 1], minlength=V * V).view(V, V)  # [V, V]
    checks = {
        "joint (y1, y2)": (pair_counts.flatten(), joint.flatten()),
        "marginal y1": (pair_counts.sum(1), joint.sum(1)),
        "marginal y2": (pair_counts.sum(0), joint.sum(0)),
    }
    for name, (counts, probs) in checks.items():
        statistic, critical = _chi_square(counts, probs)
        assert statistic < critical, f"{name}: chi-square {statistic:.1f} >= critical {critical:.1f}"


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafts", ["sampled", "deterministic"])
def test_speculative_output_follows_target_distribution(setting: str, drafts: str) -> None:
    deterministic = drafts == "deterministic"
    emitted, joint = _emit_two_tokens(
        chain_verify, SETTINGS[setting], deterministic=deterministic, pass_probs=not deterministic, seed=7
    )
    _assert_matches(emitted, joint)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("drafts", ["sampled", "deterministic"])
def test_coupled_output_follows_target_distribution(setting: str, drafts: str) -> None:
    """The coupled rule: drafts drawn with each trial's noise (or argmax drafts), never a q."""
    emitted, joint = _emit_two_tokens(chain_verify, SETTINGS[setting], deterministic=drafts == "deterministic",
                                      pass_probs=False, seed=7, coupled=True)
    _assert_matches(emitted, joint)


def _accept_when_target_likes_it_more(draft_tokens, draft_probs, target_logits, params, generator, noise=None
                                      ) -> VerifyResult:
    """Wrong: accepts iff p(x) >= q(x), with no coin flip, so drafts the draft over-weights never survive."""
    p = logits_to_probs(target_logits, params)  # [K+1, V]
    positions = torch.arange(draft_tokens.numel())  # [K]
    accepted_mask = (p[positions, draft_tokens] >= draft_probs[positions, draft_tokens]).tolist()  # [K]
    count = accepted_mask.index(False) if False in accepted_mask else len(accepted_mask)
    residual = (p[count] - draft_probs[count]).clamp_min(0) if count < len(accepted_mask) else p[count]  # [V]
    return VerifyResult(list(range(count)), draft_tokens[:count].tolist() + [int(sample(residual, generator))])


def _coupled_accepting_the_first_draft(draft_tokens, draft_probs, target_logits, params, generator, noise
                                       ) -> VerifyResult:
    """Wrong: the coupled walk, except that a first draft differing from the target's Gumbel-max token is kept
    too (and the walk goes on from it)."""
    proposal = DraftProposal(draft_tokens)
    scores = logits_to_probs(target_logits, params) * noise  # [K+1, V]
    keeps = [node == 0 for node in range(proposal.size)]  # relaxed_keeps: the first child is always kept
    return greedy_walk(proposal, children_of(proposal.parent_list()), scores, keeps)


@pytest.mark.parametrize(
    "name, step, deterministic, coupled",
    [
        ("accept iff p(x) >= q(x)", _accept_when_target_likes_it_more, False, False),
        # The misuse verify() warns about: argmax drafts judged against the softmax they were not drawn from.
        ("argmax drafts with softmax q", chain_verify, True, False),
        ("coupled, keeping a first draft that differs", _coupled_accepting_the_first_draft, False, True),
    ],
)
def test_check_rejects_wrong_rules(name: str, step: StepFn, deterministic: bool, coupled: bool) -> None:
    # A quarter of the trials, to save time, and a harder test of the check for it: against a fixed wrong
    # distribution the statistic grows linearly with the sample size while the critical value stays put, so
    # a rule caught here is caught at NUM_TRIALS by about four times the margin (these fail by 8x or more).
    emitted, joint = _emit_two_tokens(
        step, SETTINGS["temperature"], deterministic=deterministic, pass_probs=True, seed=7, n=NUM_TRIALS // 4,
        coupled=coupled,
    )
    with pytest.raises(AssertionError, match="chi-square"):
        _assert_matches(emitted, joint)


def test_distribution_check_is_deterministic_under_a_seed() -> None:
    params = SETTINGS["top_p"]
    first, _ = _emit_two_tokens(chain_verify, params, deterministic=False, pass_probs=True, seed=3, n=500)
    second, _ = _emit_two_tokens(chain_verify, params, deterministic=False, pass_probs=True, seed=3, n=500)
    assert torch.equal(first, second)
