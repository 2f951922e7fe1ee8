"""The warm-up at load (engine/warm_up.py): every first-use path runs in it, none inside a later request, and the
engine forgets what the warm-up taught it, so later output and learning start as after load."""

from __future__ import annotations

import pytest

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.drafters import registry
from specdecode.drafters.registry import DRAFTERS
from specdecode.drafters.step_choice import PRIOR_ACCEPTANCE
from specdecode.engine import engine as engine_module

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SPEC = SpecConfig("suffix,ngram,draft", num_draft_tokens=3, combine="best")
PROMPT = "abc abc abc, the cat sat on the mat; the cat sat"


class CountingDict(dict):
    """A dict that counts insertions: drafters' own weights (DrafterResources.own_weights) are built on first use."""

    inserted = 0

    def __setitem__(self, key, value):
        type(self).inserted += 1
        super().__setitem__(key, value)


def first_use_calls(monkeypatch) -> dict[str, int]:
    """Count every path a first request would take and a later one would not: a drafter built for a spec, a
    member created, a drafter's own weights built, a kernel extension compiled or loaded."""
    calls = {"build_drafter": 0, "create_member": 0, "create": 0, "kernel_load": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(engine_module, "build_drafter", counted("build_drafter", engine_module.build_drafter))
    monkeypatch.setattr(registry, "create_member", counted("create_member", registry.create_member))
    for cls in DRAFTERS.values():
        monkeypatch.setattr(cls, "create", classmethod(counted("create", cls.create.__func__)))
    import torch.utils.cpp_extension

    monkeypatch.setattr(torch.utils.cpp_extension, "load", counted("kernel_load", torch.utils.cpp_extension.load))
    return calls


def test_no_first_use_path_runs_inside_a_request_after_the_warm_up(noisy_pair, monkeypatch):
    target, draft = noisy_pair
    engine = Engine(target, draft, SPEC)
    engine.resources.own_weights = CountingDict(engine.resources.own_weights)
    calls = first_use_calls(monkeypatch)
    assert engine.warm_up() == ["none", "suffix", "ngram", "draft"]
    assert calls["build_drafter"] > 0  # the warm-up built what the requests use
    before, inserted = dict(calls), CountingDict.inserted
    for _ in range(2):
        engine.complete(PROMPT, GREEDY)
    assert calls == before and CountingDict.inserted == inserted


def test_the_engine_forgets_what_the_warm_up_taught_it(noisy_pair):
    target, draft = noisy_pair
    cold = Engine(target, draft, SPEC, prefix_cache_bytes=1 << 20)
    warmed = Engine(target, draft, SPEC, prefix_cache_bytes=1 << 20)
    warmed.warm_up()
    assert warmed.plain_clock.seconds is None  # no timing learnt from the warm-up's cold steps
    combination = warmed.drafter(SPEC)
    assert all(estimate.examined == [] for estimate in combination.chooser.members.values())
    suffix = next(part for part in combination.members if part.name == "suffix")
    assert suffix.cache_bytes() == next(part for part in cold.drafter(SPEC).members
                                        if part.name == "suffix").cache_bytes()  # no response kept
    assert warmed.prefix_cache.nbytes == 0
    first = warmed.complete(PROMPT, GREEDY)
    assert first.token_ids == cold.complete(PROMPT, GREEDY).token_ids
    assert first.token_ids == warmed.complete(PROMPT, GREEDY, SpecConfig("none")).token_ids


def test_the_warm_up_measures_what_a_sampling_member_costs_and_the_engine_keeps_it(noisy_pair):
    """The draft model (it samples its drafts) gets a WarmMeasure, the lookups none; the engine's per-step choice
    prices the draft model by it before any request timed it, and starts from its acceptance (step_choice.py)."""
    target, draft = noisy_pair
    engine = Engine(target, draft, SPEC)
    engine.warm_up()
    cost = engine.resources.warm_measures["draft"]
    assert set(engine.resources.warm_measures) == {"draft"}
    assert cost.seconds_per_token > 0 and cost.seconds_per_start_token > 0
    assert cost.acceptance is not None and 0 <= cost.acceptance <= 1  # 32 measured tokens: enough verdicts
    chooser = engine.drafter(SPEC).chooser
    assert chooser.members["draft"].seconds_per_token == 0  # no request timed it
    assert chooser.drafting_seconds("draft", 3) == pytest.approx(3 * cost.seconds_per_token)
    assert chooser.prior("draft") == cost.acceptance and chooser.prior("suffix") == PRIOR_ACCEPTANCE
    engine.forget_learned()
    assert engine.resources.warm_measures["draft"] is cost  # measured on this machine, not taught by a request


@pytest.mark.parametrize("method", ["none", "draft", "auto"])
def test_every_default_warms_up(noisy_pair, method):
    """Whatever the engine's default (auto's members, one drafter, plain decoding), its methods each run once."""
    target, draft = noisy_pair
    engine = Engine(target, draft, SpecConfig(method))
    ran = engine.warm_up()
    assert ran[0] == "none" and set(ran[1:]) == set(engine.spec.methods) - {"none"}
