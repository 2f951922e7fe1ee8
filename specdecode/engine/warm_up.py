"""A warm-up at load, so that a process's first request runs as fast as its second.

A fresh process's first steps pay for what later steps find ready: the models' weights faulted in from their
mapped files (a 1.5B w4a8 target is about a gigabyte), each drafter's own weights built or read on first use,
first calls of each kernel and allocator growth. Measured inside a request, those costs did worse than slow the
first request: the speed guard and per-step choice learnt from them that drafting loses, paused it and kept the
cheaper members, so a fresh machine's README command printed 0.52x where warm reruns printed 1.14x (#62).

So before the first request, `warm_up` runs a few short greedy requests: plain decoding and each member of the
engine's default method (or of the method a bench runner measures) alone (so every model forwards and every drafter
drafts, with the guard off so that it cannot withhold a draft), on a text that repeats so that lookups propose too.
Each member that samples its drafts (a draft model) then runs alone once more, now warm, on a chat question, and
what it cost and how often its drafts were accepted are kept as its WarmMeasure (DrafterResources.warm_measures):
per-step choice prices it by that until requests time it, and starts its acceptance estimates from it
(drafters/step_choice.py). Measured on the repeating text, the draft model's own lookup guesses (draft_lookup)
drafted several tokens a forward: 5.4 ms a drafted token, where requests' answers took 8-12 ms (#62).

Then the engine forgets what the requests taught (Engine.forget_learned): timings, per-step choice's estimates,
cross-request drafter caches, the prefix cache. The weights, built drafters' own weights and the warm measures
stay. It takes a few seconds on the default pair; the output of later requests never depends on it.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters.step_choice import WarmMeasure

if TYPE_CHECKING:
    from specdecode.engine.checked_spec import CheckedSpec
    from specdecode.engine.engine import Engine
    from specdecode.engine.stats import GenerationStats

# Code repeats, so suffix and ngram lookups find matches in it: their drafts are verified too.
WARM_TEXT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"
# Costs and acceptance are measured on a chat answer, as users ask (through the model's chat template, where it has
# one): text that repeats less than WARM_TEXT, whose first token differs, so no prefix cache serves its start. The
# default pair's acceptance came out 0.57 on a raw prose continuation and 0.60-0.92 on four short chat questions;
# on the bench's answers (MT-bench, HumanEval) `draft` alone had 0.70-0.99 by category (#62).
MEASURE_PROMPT = "How do I reverse a list in Python?"
WARM_TOKENS = 8  # per request: several verify forwards of draft-length rows, after the prompt's
# The measuring request: enough verdicts on its drafts for an acceptance to start from (MIN_VERDICTS), at about
# 50 ms a token on the default pair (w4a8).
MEASURE_TOKENS = 32
MIN_VERDICTS = 8  # examined drafts below which the warm-up's acceptance says too little to replace the prior


def warm_up(engine: Engine, default: CheckedSpec) -> list[str]:
    """Run the warm-up requests for `default`'s methods (a spec the engine checked: `auto` expanded), measure the
    sampling members' costs, then make the engine forget the requests -> the methods that ran, in order."""
    greedy = SamplingParams(temperature=0.0, max_tokens=WARM_TOKENS, ignore_eos=True)
    methods = ["none", *(m for m in default.methods if m != "none")]
    for method in methods:
        engine.complete(WARM_TEXT, greedy, _alone(default, method), raw=True)
    measuring = SamplingParams(temperature=0.0, max_tokens=MEASURE_TOKENS, ignore_eos=True)
    for method in methods:
        if engine.drafter(_alone(default, method)).caps.emits_probs:
            measure = warm_measure(engine.complete(MEASURE_PROMPT, measuring, _alone(default, method)).stats)
            if measure is not None:
                engine.resources.warm_measures[method] = measure
    engine.forget_learned()
    return methods


def warm_measure(stats: GenerationStats) -> WarmMeasure | None:
    """What a drafter's request alone measured of it (None: it drafted nothing): its costs, its start's rate only
    where it read the whole prompt, and its acceptance where enough drafts were examined."""
    if not stats.drafted_tokens:
        return None
    start = stats.drafter_prefill_seconds / stats.prompt_tokens if not stats.cached_prompt_tokens else None
    verdicts = stats.accepted_tokens + stats.rejections
    acceptance = stats.token_acceptance if verdicts >= MIN_VERDICTS else None
    verify = stats.verify_seconds / stats.target_forwards if stats.target_forwards else None
    return WarmMeasure(stats.draft_seconds / stats.drafted_tokens, start, acceptance, verify)


def _alone(default: SpecConfig, method: str) -> SpecConfig:
    """`method` alone, with the default's settings and its own options, the speed guard off (it drafts each step)."""
    return SpecConfig(method, default.num_draft_tokens, default.adaptive, _options_of(default, method), guard=False,
                      verification=default.verification)


def _options_of(spec: SpecConfig, method: str) -> dict:
    """The default spec's options that `method`'s drafter declares (a member alone takes only its own)."""
    from specdecode.drafters.registry import DRAFTERS

    declared = {item.name for item in fields(DRAFTERS[method].Options)}
    return {name: value for name, value in spec.options if name in declared}
