"""`specdecode check`: is this configuration lossless on my model and my prompts? A verdict with its numbers;
exit code 0 when every test passes, 1 when one fails (2 for a usage error, as everywhere)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from specdecode.cli.options import add_model_args, add_spec_args, build_engine, spec_from_args
from specdecode.config import DEFAULT_VERIFICATION, SamplingParams
from specdecode.errors import SpecDecodeError

INVARIANCE = {
    True: "batch-invariant here: a token's logits are bitwise the same in a forward of one row or many",
    False: "not batch-invariant here (a float target on CUDA, or on a CPU without the fixed-order layers): a "
           "forward of several rows may round a token's logits differently from one row, so greedy output can "
           "differ from plain decoding where its two likeliest tokens are nearly tied",
}
NEAR_TIE_GAP = 0.05  # logits; bf16 rounding of logits of order 10 is about 0.03
NEAR_TIE = ": a near-tie, which rounding alone can flip on this target"

DEFAULT_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Repeat this line three times: the quick brown fox jumps over the lazy dog.",
    "Explain in two sentences why the sky is blue.",
]
# Repetitive on purpose: prompt lookup and suffix decoding find something to draft in it too.
SAMPLING_PROMPT = "Continue the pattern: red green blue, red green blue, red green blue, red green"


def add_parser(commands) -> None:
    check = commands.add_parser("check", help="test that speculative decoding is lossless on your model and prompts")
    check.add_argument("prompts", nargs="*", help=f"prompts for the greedy test (default: {len(DEFAULT_PROMPTS)} "
                       "built-in ones)")
    check.add_argument("--max-tokens", type=int, default=64, help="tokens per greedy run at most (default 64)")
    check.add_argument("--trials", type=int, default=300,
                       help="sampled runs for the distribution test (default 300; 0 skips it)")
    check.add_argument("--sampling-prompt", default=SAMPLING_PROMPT, help="the prompt of the sampled runs")
    check.add_argument("--temperature", type=float, default=0.8, help="of the sampled runs (default 0.8)")
    check.add_argument("--top-k", type=int, default=20, help="of the sampled runs (default 20)")
    check.add_argument("--top-p", type=float, default=1.0, help="of the sampled runs (default 1)")
    check.add_argument("--min-p", type=float, default=0.0, help="of the sampled runs (default 0)")
    check.add_argument("--alpha", type=float, default=1e-3,
                       help="the distribution test's significance level (default 0.001)")
    check.add_argument("--json", action="store_true", help="print one JSON object with every number")
    add_model_args(check)
    add_spec_args(check)
    check.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from specdecode.bench.check import greedy_identity, sampled_distribution, sampled_identity
    from specdecode.models.batch_invariance import batch_invariant

    if args.max_tokens < 1 or args.trials < 0:
        raise SpecDecodeError("--max-tokens must be >= 1 and --trials >= 0")
    if not 0 < args.alpha < 0.5:
        raise SpecDecodeError(f"--alpha must be between 0 and 0.5, got {args.alpha}")
    if args.temperature <= 0:
        raise SpecDecodeError("--temperature must be above 0: the distribution test samples")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    spec = spec_from_args(args)
    if spec.method == "none":
        raise SpecDecodeError("--spec-type none is plain decoding: there is nothing to check")
    engine = build_engine(args, [spec], quiet=args.json)
    spec = engine.spec  # auto as the members it found
    say = (lambda text: None) if args.json else (lambda text: print(text, file=sys.stderr, flush=True))

    invariant = batch_invariant(engine.target.model)
    say(f"greedy: {spec.method} against plain decoding on {len(args.prompts or DEFAULT_PROMPTS)} prompts; the "
        f"target's forward is {INVARIANCE[invariant]}")
    cases = greedy_identity(engine, args.prompts or DEFAULT_PROMPTS, spec, args.max_tokens)
    say_cases(say, cases, "logit", invariant)
    greedy_ok = all(case.identical for case in cases)

    report = {"method": spec.method, "options": dict(spec.options), "batch_invariant": invariant,
              "greedy": [vars(c) for c in cases]}
    identity_ok = True
    if spec.verification in (None, "coupled"):  # the rule a seeded request runs by default, or the one named
        say(f"sampled identity (coupled rule): prompt i at seed i against plain decoding at that seed, temperature "
            f"{sampling.temperature}, top-k {sampling.top_k}, top-p {sampling.top_p}, min-p {sampling.min_p}")
        sampled_cases = sampled_identity(engine, args.prompts or DEFAULT_PROMPTS, spec, sampling, args.max_tokens)
        say_cases(say, sampled_cases, "log race score", invariant)
        identity_ok = all(case.identical for case in sampled_cases)
        report["sampled_identity"] = [vars(c) for c in sampled_cases]
    else:
        say(f"sampled identity: not promised under --verification {spec.verification} (only under coupled)")
    # The distribution test judges the rule a request without a seed runs (seeded ones are the identity's).
    spec = replace(spec, verification=spec.verification or DEFAULT_VERIFICATION["unseeded"])
    report["verification"] = spec.verification
    sampling_ok = True
    if args.trials:
        say(f"sampling: {args.trials} runs at temperature {sampling.temperature}, top-k {sampling.top_k}, "
            f"top-p {sampling.top_p}, min-p {sampling.min_p}, verified by the {spec.verification} rule")
        case = sampled_distribution(engine, args.sampling_prompt, spec, sampling, args.trials, args.alpha,
                                    quiet=args.json)
        test = case.test
        say(f"  chi-square {test.statistic:.1f} against {test.critical:.1f} (alpha {args.alpha}, "
            f"{test.degrees_of_freedom} degrees of freedom) over {case.tested} runs with the commonest first token; "
            f"{case.accepted}/{case.drafted} drafts accepted")
        if test.degrees_of_freedom < 3:
            say("  few cells: the target is nearly sure of these tokens, so the test has little power; a higher "
                "--temperature or a more open --sampling-prompt makes a stronger one")
        if test.impossible:
            say(f"  {test.impossible} runs emitted a pair the target gives probability 0")
        if not case.drafted:
            say("  no run drafted anything: the test says nothing about speculation (try --sampling-prompt with "
                "text this method can draft)")
        sampling_ok = case.passed
        report["sampling"] = {"trials": case.trials, "tested": case.tested, "drafted": case.drafted,
                              "accepted": case.accepted, "passed": case.passed, **vars(test)}
    # Relaxed acceptance is lossy by design: whatever these prompts showed, the configuration is not lossless.
    passed = greedy_ok and identity_ok and sampling_ok and spec.lossless
    report["passed"] = passed
    report["relaxed"] = spec.relaxed
    if args.json:
        print(json.dumps(report))
    else:
        relaxed = f", relaxed acceptance {spec.relaxed} (lossy by design)" if spec.relaxed else ""
        identity = ("identical" if identity_ok else "differs") if "sampled_identity" in report else "not promised"
        print(f"{spec.method}: {'lossless on these tests' if passed else 'NOT lossless'} (greedy "
              f"{'identical' if greedy_ok else 'differs'}, sampled at a seed {identity}, sampling "
              f"{('passed' if sampling_ok else 'failed') if args.trials else 'not run'}{relaxed})")
    return 0 if passed else 1


def say_cases(say, cases: list, margin: str, invariant: bool) -> None:
    """One line per identity case; where one differs, plain decoding's margin there (in `margin` units)."""
    for case in cases:
        verdict = "identical" if case.identical else f"DIFFERS from token {case.first_difference}"
        say(f"  {verdict:24} {case.tokens:4} tokens, {case.accepted}/{case.drafted} drafts accepted  "
            f"{case.prompt[:48]!r}")
        if case.logit_gap is not None:
            say(f"    plain decoding's two best tokens there differ by {case.logit_gap:.3g} in {margin}"
                f"{NEAR_TIE if case.logit_gap < NEAR_TIE_GAP and not invariant else ''}")
