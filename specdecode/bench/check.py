"""Is speculative decoding lossless for this model, method and these prompts? Three tests, on the user's setup.

Greedy: each prompt's output token for token against plain decoding through the same Engine.

Sampled identity (the coupled rule): each prompt's sampled output at a seed token for token against plain decoding's
at that seed, which the coupled rule promises whatever was drafted (acceptance/noise.py).

Sampling: many short sampled runs of one prompt (one seed each). The engine samples the first token from the
prefill, then drafts the second and verifies it: the second token comes from the acceptance rule and the third
from the verify forward's next row, the residual law after a rejection included. Among the runs whose first
token was the most common one, the pairs (second, third) must follow the target's own law, computed from the
target's logits through the same sampling transform; Pearson's chi-square decides at level `alpha`. Pairs
outside the second token's few likeliest values share one cell.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from specdecode.acceptance.chi_square import ChiSquare, chi_square
from specdecode.acceptance.noise import PositionNoise
from specdecode.acceptance.sampling import logits_to_probs
from specdecode.config import SamplingParams, SpecConfig
from specdecode.engine.engine import Engine

SECOND_TOKENS = 8  # second-token values whose third-token law is computed exactly (one target forward each)


@dataclass
class IdentityCase:
    prompt: str
    tokens: int  # plain decoding's output length
    first_difference: int | None  # the first output position where the two differ; None = identical
    drafted: int
    accepted: int
    # At the first difference: plain decoding's margin there, between its two best tokens' logits (greedy) or log
    # race scores, log p w (sampled). A margin within rounding says a forward of several rows rounded differently
    # from one row (a target that is not batch-invariant); a wide one says a token was lost.
    logit_gap: float | None = None

    @property
    def identical(self) -> bool:
        return self.first_difference is None


@dataclass
class DistributionCase:
    trials: int
    tested: int  # runs whose first token was the most common one (the sample the test uses)
    drafted: int  # tokens drafted over all runs: with none, the test says nothing about speculation
    accepted: int
    test: ChiSquare

    @property
    def passed(self) -> bool:
        return self.drafted > 0 and self.test.passed


def greedy_identity(engine: Engine, prompts: list[str], spec: SpecConfig, max_tokens: int) -> list[IdentityCase]:
    return _identity(engine, prompts, spec, SamplingParams(max_tokens=max_tokens))


def sampled_identity(engine: Engine, prompts: list[str], spec: SpecConfig, sampling: SamplingParams,
                     max_tokens: int) -> list[IdentityCase]:
    """Prompt i sampled at seed i under the coupled rule, against plain decoding at that seed."""
    return [_identity(engine, [prompt], replace(spec, verification="coupled"),
                      replace(sampling, max_tokens=max_tokens, seed=seed))[0] for seed, prompt in enumerate(prompts)]


def _identity(engine: Engine, prompts: list[str], spec: SpecConfig, sampling: SamplingParams) -> list[IdentityCase]:
    cases = []
    plain_spec = SpecConfig("none", verification=spec.verification)
    for prompt in prompts:
        plain = engine.complete(prompt, sampling, plain_spec).token_ids
        result = engine.complete(prompt, sampling, spec)
        ours = result.token_ids
        differs = [i for i, (a, b) in enumerate(zip(plain, ours)) if a != b]
        first = differs[0] if differs else (None if len(plain) == len(ours) else min(len(plain), len(ours)))
        gap = None  # plain decoding's margin where the outputs part, when they part inside plain's output
        if first is not None and first < len(plain):
            gap = _margin(engine, engine.encode(prompt) + plain[:first], sampling)
        cases.append(IdentityCase(prompt, len(plain), first, result.stats.drafted_tokens,
                                  result.stats.accepted_tokens, gap))
    return cases


def _margin(engine: Engine, ids: list[int], sampling: SamplingParams) -> float:
    """Plain decoding's best score minus its second after `ids`, read in one forward: logits when greedy, log p w
    (the coupled race's scores at that position, seeded by `sampling.seed`) when sampling."""
    logits = _last_logits(engine, ids).float()  # [V]
    if sampling.greedy:
        scores = logits
    else:
        weights = PositionNoise(sampling.seed, logits.numel(), logits.device).rows([len(ids)])[0]  # [V]
        scores = (logits_to_probs(logits, sampling) * weights).log()  # [V]
    top = scores.topk(2).values  # [2]
    return float(top[0] - top[1])


def sampled_distribution(engine: Engine, prompt: str, spec: SpecConfig, sampling: SamplingParams, trials: int,
                         alpha: float, quiet: bool = False) -> DistributionCase:
    ids = engine.encode(prompt)
    short = replace(sampling, max_tokens=3, ignore_eos=True, stop=(), logprobs=None)
    runs, drafted, accepted = [], 0, 0
    for trial in tqdm(range(trials), desc="sampled runs", unit="run", disable=quiet):
        result = engine.complete(ids, replace(short, seed=trial), spec)
        runs.append(result.token_ids)
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    first = Counter(run[0] for run in runs).most_common(1)[0][0]
    pairs = [(run[1], run[2]) for run in runs if run[0] == first]
    law, cell_of = _pair_law(engine, ids + [first], sampling)
    counts = torch.zeros_like(law)  # [cells]
    for pair in pairs:
        counts[cell_of(pair)] += 1
    return DistributionCase(trials, len(pairs), drafted, accepted, chi_square(counts, law, alpha))


def _pair_law(engine: Engine, context: list[int], sampling: SamplingParams):
    """The target's law of the next two tokens after `context`: cells (i, t) for the i-th likeliest second
    token and any third token t, and one last cell for every pair whose second token is not among those."""
    second = _next_probs(engine, context, sampling)  # [V]
    likeliest = [int(t) for t in second.topk(min(SECOND_TOKENS, second.numel())).indices if second[t] > 0]
    rows = [second[t] * _next_probs(engine, context + [t], sampling) for t in likeliest]  # each [V]
    rest = 1 - sum(float(second[t]) for t in likeliest)
    law = torch.cat([torch.stack(rows).flatten(), torch.tensor([max(rest, 0.0)])])  # [S * V + 1]
    slot = {t: i for i, t in enumerate(likeliest)}
    vocab = second.numel()

    def cell_of(pair: tuple[int, int]) -> int:
        i = slot.get(pair[0])
        return len(law) - 1 if i is None else i * vocab + pair[1]

    return law, cell_of


def _next_probs(engine: Engine, ids: list[int], sampling: SamplingParams) -> torch.Tensor:
    return logits_to_probs(_last_logits(engine, ids), sampling).double().cpu()  # [V]


def _last_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """The target's logits for the token after `ids` [V], from one forward over them."""
    model = engine.target.model
    with torch.inference_mode():
        tokens = torch.tensor([ids], device=model.device)  # [1, T]
        positions = torch.arange(len(ids), device=model.device).unsqueeze(0)  # [1, T]
        logits = model(tokens, positions, model.new_cache(len(ids)), logits_at=slice(-1, None)).logits  # [1, 1, V]
    return logits[0, -1]
