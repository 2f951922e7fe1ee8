"""Block against token-wise verification on the same drafts: the expected accepted length of each rule.

A bench run of two rules samples two different texts, and at temperature > 0 the spread between texts hides a few
percent. Here one decoding runs (the default pair, `draft`, fixed draft length, no guard), and at every step whose
proposal carries the draft's distributions both rules judge that same proposal against the same target rows
DRAWS times each, with generators of their own (verification is a pure function: nothing of the run changes). The
run itself goes on with the rule it was given. Prints, per temperature, the mean accepted tokens per drafted
block and the mean accepted length (tokens per target forward, the bonus token included) of each rule; the last
line is JSON.

    python docs/benchmarks/block_verification.py --prompts 8 --temperatures 0.7,1.0
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import mean

import torch

from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.acceptance import verify as verify_module
from specdecode.engine import engine as engine_module
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def prompts(count: int) -> list[str]:
    """The first `count` HumanEval prompts and the first turn of the first `count` MT-bench questions."""
    files = [DATA / "humaneval" / "humaneval_specbench_format.jsonl", DATA / "mt_bench" / "question.jsonl"]
    return [json.loads(line)["turns"][0] for file in files for line in file.read_text().splitlines()[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="of each dataset")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="draft length, fixed")
    parser.add_argument("--draws", type=int, default=64, help="verifications of each proposal by each rule")
    args = parser.parse_args()
    engine = Engine(load_model(DEFAULT_TARGET, quant="w4a8"), load_model(DEFAULT_DRAFT, quant="w4a8"))
    accepted: dict[bool, list[float]] = {}
    original = verify_module.verify

    def judged_twice(proposal, logits, params, generator, relaxed=None, block=False):
        if proposal.probs is not None and proposal.is_chain and proposal.size and not params.greedy:
            for rule in (True, False):
                draws = [original(proposal, logits, params, torch.Generator().manual_seed(seed), block=rule)
                         for seed in range(args.draws)]
                accepted[rule].append(mean(result.num_accepted for result in draws))
        return original(proposal, logits, params, generator, relaxed, block)

    engine_module.verify = judged_twice
    report = {}
    for temperature in (float(t) for t in args.temperatures.split(",")):
        accepted.update({True: [], False: []})
        spec = SpecConfig("draft", num_draft_tokens=args.k, adaptive=False, guard=False)
        for index, prompt in enumerate(prompts(args.prompts)):
            engine.complete(prompt, SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=index),
                            spec)
        block, token = mean(accepted[True]), mean(accepted[False])
        report[str(temperature)] = {"steps": len(accepted[True]), "block_accepted": round(block, 3),
                                    "token_accepted": round(token, 3), "block_length": round(block + 1, 3),
                                    "token_length": round(token + 1, 3),
                                    "length_gain": round((block + 1) / (token + 1) - 1, 4)}
        print(f"T={temperature}: {len(accepted[True])} proposals of {args.k}; accepted per block: block "
              f"{block:.3f}, token-wise {token:.3f}; mean accepted length {block + 1:.3f} against {token + 1:.3f} "
              f"({(block + 1) / (token + 1) - 1:+.1%})", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
