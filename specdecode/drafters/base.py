"""The drafter protocol: lifetimes, capabilities as data, and options declared once with their peers' names.

Lifetimes: `create(resources, options)` runs once per Engine (per distinct options) and owns weights and
cross-request caches. Per request: `start` after the target's prefill, then each step `propose` and, after
verification, `commit` with the target's output gathered along the accepted path; `finish` at the end.
A drafter keeps per-request state in `seq.drafter_state[self.name]`, never on itself, so one drafter serves
every request of an Engine, interleaved or not.

What a drafter needs is data the engine reads instead of asking which method it runs (`DrafterCaps`): which
target hidden states it reads (boundary ids, DESIGN.md), whether it reads the final hidden state, whether it emits
draft probabilities or trees, whether its proposals have a fixed block size, whether it needs a draft model. What
it can do beyond the core (batched proposals, memory sizing, a deferred start, `auto`'s declarations) are
optional capabilities a class declares by inheriting them (capabilities.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from specdecode.errors import SpecDecodeError
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

if TYPE_CHECKING:
    import torch

    from specdecode.drafters.step_choice import WarmMeasure
    from specdecode.models.loader import LoadedModel


@dataclass(frozen=True)
class DrafterCaps:
    hidden_layers: tuple[int, ...] = ()  # target hidden states it reads, by boundary id
    final_hidden: bool = False  # reads the target's hidden state after the final norm
    emits_probs: bool = False  # may propose nodes drawn from a distribution q (else deterministic drafts)
    emits_trees: bool = False  # may propose trees, not only chains
    block_size: int | None = None  # proposals of a fixed size (a block drafter), else the adaptive length
    needs_draft_model: bool = False  # callers must load a draft model for it
    draft_files: bool = False  # it reads its own weights from --draft-head PATH (an EAGLE-3 head), not a model
    drafts: bool = True  # False for plain decoding: no steps to guard or explain (speed_guard.py)


@dataclass
class DrafterResources:
    """What a drafter may need to build itself, once per Engine; each takes what it uses."""

    target: LoadedModel
    draft: LoadedModel | None = None
    context_limit: int = 0
    # --draft-head as given, for drafters with their own weight format: one path, or method -> its path
    draft_path: str | dict[str, str] | None = None
    draft_quant: str = "none"  # what a drafter's own weights run as: none, int8, int4, w4a8 or w3a8
    # Weights a drafter loaded itself (an EAGLE-3 head), by what it read: configurations of one drafter that
    # differ only in options share them, and the Engine counts them once.
    own_weights: dict[str, torch.nn.Module] = field(default_factory=dict)
    # Method -> what the Engine's warm-up measured of it drafting alone (engine/warm_up.py: costs, acceptance, the
    # verify step), for per-step choice until requests time their own (step_choice.py). Measured on this machine
    # outside any request, so Engine.forget_learned keeps them.
    warm_measures: dict[str, WarmMeasure] = field(default_factory=dict)

    def path_for(self, method: str) -> str | None:
        """The folder method `method` reads its own weights from, or None."""
        return self.draft_path.get(method) if isinstance(self.draft_path, dict) else self.draft_path


def option(default: Any, help: str, llama_cpp: str | None = None, vllm: str | None = None,
           cli: tuple[str, ...] = (), serve_default: Any = None, within_vocab: bool = False, **bounds: float) -> Any:
    """A drafter option: its default, a help line, and the names llama.cpp's server flags and vLLM's
    `speculative_config` give it (accepted as aliases by our CLI and `--speculative-config`). `serve_default`,
    when set, replaces the default in `specdecode serve` (a server is shared by users who may not see each
    other's data). `bounds` (ge, gt, le, lt) are the values a number takes: checked for every front door
    (check_bounds) and published in the server's request schema; `within_vocab`: at most the target's vocabulary
    size too, which only a loaded engine knows (checked by the drafter, published by the server)."""
    return field(default=default, metadata={"help": help, "llama_cpp": llama_cpp, "vllm": vllm, "cli": cli,
                                            "serve_default": serve_default, "bounds": bounds,
                                            "within_vocab": within_vocab})


_WITHIN = {"ge": lambda v, b: v >= b, "gt": lambda v, b: v > b, "le": lambda v, b: v <= b, "lt": lambda v, b: v < b}


def check_bounds(options: Any) -> None:
    """Raise SpecDecodeError naming the first option outside its declared bounds."""
    for item in fields(options):
        bounds, value = item.metadata.get("bounds", {}), getattr(options, item.name)
        if not all(_WITHIN[kind](value, bound) for kind, bound in bounds.items()):
            raise SpecDecodeError(f"{item.name} must be {describe_bounds(bounds)}, got {value}")


def describe_bounds(bounds: dict[str, float]) -> str:
    """{"ge": 1, "le": 8} -> "between 1 and 8"; one-sided and open bounds in words."""
    low = f"at least {bounds['ge']}" if "ge" in bounds else f"above {bounds['gt']}" if "gt" in bounds else None
    high = f"at most {bounds['le']}" if "le" in bounds else f"below {bounds['lt']}" if "lt" in bounds else None
    if "ge" in bounds and "le" in bounds:
        return f"between {bounds['ge']} and {bounds['le']}"
    return " and ".join(part for part in (low, high) if part)


@dataclass(frozen=True)
class NoOptions:
    def check(self) -> None:
        """Raise SpecDecodeError on values that make no sense together (single values are typed)."""


class Drafter(ABC):
    """The core every drafter implements: how it is built once per Engine (`create`, required), what it proposes
    each step (`propose`, required), and the request's lifecycle around it (`start`, `commit`, `finish`, which do
    nothing unless a drafter keeps state per request). Anything more is an optional capability
    (capabilities.py). The registry refuses a class that leaves a required method out (registry.register)."""

    name: ClassVar[str]
    caps: DrafterCaps = DrafterCaps()  # a class default; an instance may refine it from its weights in create()
    Options: ClassVar[type] = NoOptions
    aliases: ClassVar[tuple[str, ...]] = ()  # other runtimes' method names for it (llama.cpp's --spec-type)
    vllm_method: ClassVar[str | None] = None  # vLLM's speculative_config "method" for it
    tree_options: ClassVar[dict[str, Any]] = {}  # options that make it propose trees (when caps.emits_trees)
    weights_kind: ClassVar[str] = "weights of its own"  # what --draft-head names for it, when caps.draft_files

    @classmethod
    @abstractmethod
    def create(cls, resources: DrafterResources, options: Any) -> Drafter:
        """The drafter for these resources and options, once per Engine: weights and cross-request caches."""

    @abstractmethod
    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        """At most `budget` tokens on any root-to-leaf path (the context and token budget allow no more)."""

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        """After the target's prefill: `seq.tokens` holds the prompt and the first generated token; `prefill`
        covers the prompt's rows (hidden states at every row, logits at the last)."""

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        """After `seq.tokens` gained `result.tokens`; `target` holds the verify forward's rows along the accepted
        path (the root, then each accepted node). `result.source` says whose proposal was verified."""

    def finish(self, seq: Sequence) -> None:
        """The request ended: drop its state."""
        seq.drafter_state.pop(self.name, None)

    @classmethod
    def check_resources(cls, resources: DrafterResources, options: Any = None) -> None:
        """Raise SpecDecodeError when what it needs was not loaded or named (a draft model, a folder of its own
        weights), saying which flag gives it, or when one of its `options` (None: the defaults) cannot apply to
        what was loaded (a token count beyond the target's vocabulary); building nothing."""
        if cls.caps.needs_draft_model and resources.draft is None:
            raise SpecDecodeError(f"method '{cls.name}' needs a draft model (--draft-model NAME_OR_PATH)")
        if cls.caps.draft_files and resources.path_for(cls.name) is None:
            raise SpecDecodeError(f"method '{cls.name}' needs {cls.weights_kind}: --draft-model PATH (a folder with "
                                  "config.json and safetensors weights), or --draft-head PATH beside a draft model")
