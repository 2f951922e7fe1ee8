"""The step contract hosts a new drafter with no change to the engine, verification or the front doors.

A drafter written here, in one class, reads target hidden states (two boundary ids and the final hidden) and
proposes trees. Registering it is all it takes: the CLI grows its option, the engine hands it the hidden states
of the prompt at start and of the accepted path at each commit, and the contract (greedy identity, the KV
cache) holds. The hidden states it collects must be, row for row, what a fresh forward over the committed
tokens computes: that alignment is what EAGLE-3, MTP and DFlash drafters rely on.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import save_tiny_model, started

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.cli.main import build_parser
from specdecode.drafters.base import Drafter, DrafterCaps, option
from specdecode.drafters.capabilities import DeferredStart, MemorySizing
from specdecode.drafters.registry import DRAFTERS, register
from specdecode.models.loader import load_model
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

LAYERS = (0, 2)


@dataclass(frozen=True)
class EchoOptions:
    echo_branches: int = option(2, "siblings per level", vllm="echo_branches")

    def check(self) -> None:
        pass


class HiddenEchoDrafter(Drafter, MemorySizing):
    """Proposes two levels of a tree from the last tokens; records every hidden state the engine hands it."""

    name = "test-hidden-echo"
    caps = DrafterCaps(hidden_layers=LAYERS, final_hidden=True, emits_trees=True)
    Options = EchoOptions
    tree_options = {"echo_branches": 2}

    def __init__(self, options: EchoOptions):
        self.branches = options.echo_branches

    @classmethod
    def create(cls, resources, options: EchoOptions) -> HiddenEchoDrafter:
        return cls(options)

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        assert prefill.logits.shape[0] == 1  # the prompt's last row
        seq.drafter_state[self.name] = {k: [prefill.hidden[k]] for k in LAYERS} | {"final": [prefill.final_hidden]}

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        recent = list(dict.fromkeys(reversed(seq.tokens)))[: self.branches]  # the latest distinct tokens
        tokens, parents = list(recent), [-1] * len(recent)
        if budget > 1:
            for node in range(len(recent)):
                tokens.append(seq.tokens[-2] if len(seq.tokens) > 1 else recent[0])
                parents.append(node)
        return DraftProposal(torch.tensor(tokens), torch.tensor(parents), None, self.name)

    def max_nodes(self, budget: int) -> int:
        return 2 * self.branches

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        state = seq.drafter_state[self.name]
        rows = len(result.kept_rows)
        for k in LAYERS:
            assert target.hidden[k].shape[0] == rows
            state[k].append(target.hidden[k])
        state["final"].append(target.final_hidden)


@pytest.fixture
def registered():
    register(HiddenEchoDrafter)
    yield HiddenEchoDrafter
    del DRAFTERS[HiddenEchoDrafter.name]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_tiny_model(tmp_path_factory.mktemp("echo") / "t", "qwen2", scale=0.15), dtype="float32")


def test_a_drafter_registered_in_one_file_gets_hidden_states_along_the_accepted_path(registered, target):
    engine = Engine(target)
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = "abcabc abcabc abc"
    plain = engine.complete(prompt, sampling, SpecConfig("none")).token_ids
    spec = SpecConfig(registered.name, num_draft_tokens=2, options={"echo_branches": 3})
    seq = started(engine, engine.encode(prompt), sampling, spec)
    state = seq.drafter_state[registered.name]
    while seq.generated < sampling.max_tokens:
        engine.step(seq)
    assert seq.tokens[seq.prompt_len:] == plain  # lossless, trees and all
    assert seq.stats.accepted_tokens > 0 and seq.stats.drafted_tokens > seq.stats.accepted_tokens

    committed = seq.tokens[:-1]  # every token the target has seen
    with torch.inference_mode():
        fresh = target.model(torch.tensor([committed]), torch.arange(len(committed)).unsqueeze(0),
                             target.model.new_cache(len(committed)), hidden_layers=LAYERS, final_hidden=True)
    for key in LAYERS:
        assert torch.allclose(torch.cat(state[key]), fresh.hidden[key][0], atol=1e-5)
    assert torch.allclose(torch.cat(state["final"]), fresh.final_hidden[0], atol=1e-5)
    engine.finish(seq)
    assert registered.name not in seq.drafter_state


def test_its_options_reach_the_command_line(registered):
    args = build_parser().parse_args(["generate", "hi", "--spec-type", registered.name, "--echo-branches", "4"])
    assert args.echo_branches == 4


def test_a_drafter_missing_a_required_method_is_refused_at_registration():
    """The core is abstract: a class without `propose` (or a method of a capability it declares) fails when it
    registers, naming what it lacks, instead of at its first step."""

    class Silent(Drafter):
        name = "test-silent"

        @classmethod
        def create(cls, resources, options) -> Silent:
            return cls()

    with pytest.raises(TypeError, match="propose"):
        register(Silent)

    class Forgetful(HiddenEchoDrafter, DeferredStart):
        name = "test-forgetful"  # declares a deferred start but says nothing of how far behind it is

        def defer_start(self, seq: Sequence) -> None:
            seq.drafter_state[self.name] = {}

    with pytest.raises(TypeError, match="pending_tokens"):
        register(Forgetful)
    assert "test-silent" not in DRAFTERS and "test-forgetful" not in DRAFTERS


def test_the_core_has_at_most_six_required_methods():
    """The lifecycle is the whole core: everything else is an optional capability (capabilities.py)."""
    assert Drafter.__abstractmethods__ == {"create", "propose"}
    core = {"create", "start", "propose", "commit", "finish", "check_resources"}
    methods = {name for name, value in vars(Drafter).items()
               if isinstance(value, (classmethod, staticmethod)) or callable(value) and not isinstance(value, type)}
    assert {name for name in methods if not name.startswith("_")} == core
