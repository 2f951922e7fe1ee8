"""`advise`: a short measured trial of every candidate method on the user's own prompts, ranked.

The seed's advice ends in "try it, and measure": this is that trial, in one process, against plain decoding on
the same prompts (the bench's machinery, its speedups and identical-output rates), with the command line of the
winner.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields

from specdecode.bench.datasets import Question
from specdecode.bench.metrics import summarize
from specdecode.bench.runner import MethodSpec
from specdecode.bench.suite import run_all, runner_factories
from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters import capabilities
from specdecode.drafters.registry import DRAFTERS, needs_draft_model
from specdecode.engine.engine import Engine

WITHOUT_DRAFT_MODEL = "ngram,suffix,recycle,ngram:ngram_branches=3"
WITH_DRAFT_MODEL = WITHOUT_DRAFT_MODEL + ",draft,ngram+draft,suffix+draft,draft:k=5"


@dataclass
class Ranked:
    method: str
    spec: SpecConfig
    tokens_per_second: float
    speedup: float  # over plain decoding on the same prompts, in the same run
    acceptance_rate: float | None
    mean_accepted_length: float | None
    # outputs equal to plain decoding's, greedy or coupled at the trial's seed (None under the other sampling rules)
    identical_rate: float | None
    weights_bytes: int  # the models this method keeps in memory


def default_candidates(has_draft: bool, ships_mtp: bool = False) -> str:
    """The methods tried when the user names none: lookups, the draft model's when there is one, and the
    target's own MTP layers when it ships them (over the frequent 16000 tokens, the default, and its whole
    vocabulary)."""
    mtp = ",mtp,mtp:mtp_draft_vocab=0" if ships_mtp else ""
    return (WITH_DRAFT_MODEL if has_draft else WITHOUT_DRAFT_MODEL) + mtp


def prompts_as_questions(prompts: list[str]) -> list[Question]:
    return [Question(f"prompt-{i}", "yours", (prompt,)) for i, prompt in enumerate(prompts)]


def trial(engine: Engine, questions: list[Question], methods: list[MethodSpec],
          sampling: SamplingParams) -> list[Ranked]:
    """Every method (bench.suite.parse_methods' list: plain decoding first) on the questions; fastest first."""
    for method in methods:
        engine.check_spec(method.spec)
    raw = run_all(questions, methods, runner_factories(engine, methods, []), sampling, repeats=1)
    ranked = []
    for method in methods:
        summary = summarize(raw[method.name], raw["none"])
        ranked.append(Ranked(method.name, method.spec, summary["tokens_per_second"], summary["speedup"],
                             summary.get("acceptance_rate"), summary.get("mean_accepted_length"),
                             summary["identical_rate"] if method.spec.verification_for(sampling) == "coupled"
                             or sampling.greedy else None,
                             _weights_bytes(engine, method)))
    return sorted(ranked, key=lambda r: -r.tokens_per_second)


def _weights_bytes(engine: Engine, method: MethodSpec) -> int:
    models = [engine.target] + ([engine.draft] if needs_draft_model(method.spec) else [])
    return sum(m.weights_bytes for m in models) + capabilities.weights_bytes(engine.drafter(method.spec))


def command_line(ranked: Ranked, model_flags: list[str]) -> str:
    """The `specdecode generate` flags that run this method (options that differ from their defaults only)."""
    spec = ranked.spec
    flags = ["specdecode", "generate", "PROMPT", *model_flags, "--spec-type", spec.method]
    if spec.method != "none":
        flags += ["--num-draft-tokens", str(spec.num_draft_tokens)]
    used = {item.name: item.default for name in spec.methods if name in DRAFTERS
            for item in fields(DRAFTERS[name].Options)}
    for name, value in spec.options:
        if name in used and value != used[name]:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return shlex.join(flags)
