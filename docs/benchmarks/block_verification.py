"""Coupled, block and token-wise verification on the same drafts: the expected accepted length of each rule.

A bench run of two rules samples two different texts, and at temperature > 0 the spread between texts hides a few
percent. Here one decoding runs per method (`draft`, and a lookup such as `ngram`; fixed draft length, no guard)
with the token-wise rule, so a sampling drafter's proposals carry the law q each token was drawn from. At every
sampled step each rule judges that same proposal against the same target rows (verification is a pure function:
nothing of the run changes):

- token and block: DRAWS times each, with generators of their own;
- coupled: exactly, given the proposal. Under coupled a sampling drafter's token is X = argmax(log q + g) and the
  target's Y = argmax(log p + g) with the same Gumbel noise g of the position, so (X, g) is jointly a draw X ~ q
  and g given that argmax. Conditioning on g_X = t, Y = X needs g_i < t + min(log p_X - log p_i, log q_X - log q_i)
  for every other i; integrating over t gives P(X = Y = x) = 1 / sum_i max(p_i / p_x, q_i / q_x), so
  P(Y = x | X = x) = 1 / sum_i max(p_i q_x / p_x, q_i). Rows are independent (each position has its own noise),
  so the expected accepted count is the sum over j of the product of the first j rows' chances. A lookup's draft
  is deterministic (q one-hot): the chance is p(x), as token-wise verification's.

Prints, per method and temperature, the mean accepted tokens per proposal and the mean accepted length (tokens per
target forward, the bonus included) of each rule, and coupled's length over block's; the last line is JSON.

    python docs/benchmarks/block_verification.py --prompts 8 --temperatures 0.7,1.0 --methods draft,ngram

The defaults load the default pair, both in w4a8; `--target`, `--draft`, `--quant none`, `--draft-quant none` and
`--dtype float32` run it on any other pair, such as the tests' tiny models.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean

import torch

from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.acceptance import verify as verify_module
from specdecode.acceptance.sampling import logits_to_probs
from specdecode.engine import request as request_module
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
RULES = ("coupled", "block", "token")


def prompts(count: int) -> list[str]:
    """The first `count` HumanEval prompts and the first turn of the first `count` MT-bench questions."""
    files = [DATA / "humaneval" / "humaneval_specbench_format.jsonl", DATA / "mt_bench" / "question.jsonl"]
    return [json.loads(line)["turns"][0] for file in files for line in file.read_text().splitlines()[:count]]


def coupled_expected_accepted(drafts: list[int], p: torch.Tensor, q: torch.Tensor | None) -> float:
    """The coupled rule's expected accepted drafts of a chain: p [γ+1, V] the target's laws, q [γ, V] the drafter's
    (None: deterministic drafts)."""
    expected, survive = 0.0, 1.0
    for row, token in enumerate(drafts):
        p_row = p[row].double()  # [V]
        if p_row[token] == 0:
            break
        if q is None:
            chance = float(p_row[token])
        else:
            q_row = q[row].double()  # [V]
            chance = float(1 / torch.maximum(p_row * q_row[token] / p_row[token], q_row).sum())
        survive *= chance
        expected += survive
    return expected


def judge(proposal, logits: torch.Tensor, params: SamplingParams, draws: int, first_seed: int) -> dict[str, float]:
    """Accepted drafts of `proposal` under each rule: coupled's expectation, block's and token-wise's means over
    `draws` verifications each, seeded from `first_seed` on (each proposal its own seeds: with the same ones, every
    proposal's estimate would share the same few uniforms' error, which does not average out)."""
    drafts = proposal.tokens.tolist()
    p = logits_to_probs(logits, params)  # [γ+1, V]
    accepted = {"coupled": coupled_expected_accepted(drafts, p, proposal.probs)}
    for rule in ("block", "token"):
        accepted[rule] = mean(verify_module.verify(proposal, logits, params, torch.Generator().manual_seed(seed),
                                                   block=rule == "block").num_accepted
                              for seed in range(first_seed, first_seed + draws))
    return accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="of each dataset")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--methods", default="draft,ngram", help="a sampling drafter and a lookup, or any others")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="draft length, fixed")
    parser.add_argument("--draws", type=int, default=64, help="verifications of each proposal by block and token")
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--quant", default="w4a8", help="the target's (none: --dtype)")
    parser.add_argument("--draft-quant", default="w4a8", help="the draft model's (none: --dtype)")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engine = Engine(load_model(args.target, dtype=args.dtype, quant=args.quant),
                    load_model(args.draft, dtype=args.dtype, quant=args.draft_quant))
    judged: list[dict[str, float]] = []
    original = request_module.verify

    def judging(proposal, logits, params, generator, relaxed=None, block=False, noise=None):
        if proposal.is_chain and proposal.size and not params.greedy:
            judged.append(judge(proposal, logits, params, args.draws, len(judged) * args.draws))
        return original(proposal, logits, params, generator, relaxed, block, noise)

    request_module.verify = judging
    report = {}
    for method in args.methods.split(","):
        for temperature in (float(t) for t in args.temperatures.split(",")):
            judged.clear()
            spec = SpecConfig(method, num_draft_tokens=args.k, adaptive=False, guard=False, verification="token")
            for index, prompt in enumerate(prompts(args.prompts)):
                engine.complete(prompt, SamplingParams(temperature=temperature, max_tokens=args.max_tokens,
                                                       seed=index), spec)
            means = {rule: mean(step[rule] for step in judged) for rule in RULES}
            report[f"{method}@{temperature}"] = {
                "steps": len(judged), **{f"{rule}_accepted": round(means[rule], 3) for rule in RULES},
                **{f"{rule}_length": round(means[rule] + 1, 3) for rule in RULES},
                "coupled_over_block": round((means["coupled"] + 1) / (means["block"] + 1), 4)}
            print(f"{method} T={temperature}: {len(judged)} proposals of up to {args.k}; accepted per proposal: "
                  + ", ".join(f"{rule} {means[rule]:.3f}" for rule in RULES)
                  + f"; mean accepted length coupled {means['coupled'] + 1:.3f} against block "
                  f"{means['block'] + 1:.3f} ({(means['coupled'] + 1) / (means['block'] + 1):.1%})", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
