"""A warm-up at load, so that a process's first request runs as fast as its second.

A fresh process's first steps pay for what later steps find ready: the models' weights faulted in from their
mapped files (a 1.5B w4a8 target is about a gigabyte), each drafter's own weights built or read on first use,
first calls of each kernel and allocator growth. Measured inside a request, those costs did worse than slow the
first request: the speed guard and per-step choice learnt from them that drafting loses, paused it and kept the
cheaper members, so a fresh machine's README command printed 0.52x where warm reruns printed 1.14x (#62).

So before the first request, `warm_up` runs a few short greedy requests: plain decoding and each member of the
engine's default method alone (so every model forwards and every drafter drafts, with the guard off so that it
cannot withhold a draft), on a text that repeats so that lookups propose too. Each member that samples its drafts
(a draft model) then runs alone once more, now warm, on another text, and what it cost is kept as its DraftingCost
(DrafterResources.warm_costs): per-step choice prices it by that until requests time it (drafters/step_choice.py).
Then the engine forgets what the requests taught (Engine.forget_learned): timings, per-step choice's estimates,
cross-request drafter caches, the prefix cache. The weights, built drafters' own weights and the measured costs
stay. It takes a few seconds on the default pair; the output of later requests never depends on it.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters.step_choice import DraftingCost

if TYPE_CHECKING:
    from specdecode.engine.engine import Engine
    from specdecode.engine.stats import GenerationStats

# Code repeats, so suffix and ngram lookups find matches in it: their drafts are verified too.
WARM_TEXT = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(a, b):\n"
# Costs are measured on another text: its first token differs, so no prefix cache serves its start from WARM_TEXT's.
MEASURE_TEXT = "class Point:\n    def __init__(self, x):\n        self.x = x\n\n\nclass Point:\n    def __init__"
WARM_TOKENS = 8  # per request: several verify forwards of draft-length rows, after the prompt's


def warm_up(engine: Engine) -> list[str]:
    """Run the warm-up requests, measure the sampling members' costs, then make the engine forget the requests ->
    the methods that ran, in order."""
    default = engine.spec
    greedy = SamplingParams(temperature=0.0, max_tokens=WARM_TOKENS, ignore_eos=True)
    methods = ["none", *(m for m in default.methods if m != "none")]
    for method in methods:
        engine.complete(WARM_TEXT, greedy, _alone(default, method), raw=True)
    for method in methods:
        if engine.drafter(_alone(default, method)).caps.emits_probs:
            cost = drafting_cost(engine.complete(MEASURE_TEXT, greedy, _alone(default, method), raw=True).stats)
            if cost is not None:
                engine.resources.warm_costs[method] = cost
    engine.forget_learned()
    return methods


def drafting_cost(stats: GenerationStats) -> DraftingCost | None:
    """A drafter's costs from a request it drafted alone (None: it drafted nothing); its start's rate only where
    it read the whole prompt."""
    if not stats.drafted_tokens:
        return None
    start = stats.drafter_prefill_seconds / stats.prompt_tokens if not stats.cached_prompt_tokens else None
    return DraftingCost(stats.draft_seconds / stats.drafted_tokens, start)


def _alone(default: SpecConfig, method: str) -> SpecConfig:
    """`method` alone, with the default's settings and its own options, the speed guard off (it drafts each step)."""
    return SpecConfig(method, default.num_draft_tokens, default.adaptive, _options_of(default, method), guard=False,
                      verification=default.verification)


def _options_of(spec: SpecConfig, method: str) -> dict:
    """The default spec's options that `method`'s drafter declares (a member alone takes only its own)."""
    from specdecode.drafters.registry import DRAFTERS

    declared = {item.name for item in fields(DRAFTERS[method].Options)}
    return {name: value for name, value in spec.options if name in declared}
