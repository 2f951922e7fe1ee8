"""The drafter protocol: lifetimes, capabilities as data, and options declared once with their peers' names.

Lifetimes: `create(resources, options)` runs once per Engine (per distinct options) and owns weights and
cross-request caches. Per request: `start` after the target's prefill, then each step `propose` and, after
verification, `commit` with the target's output gathered along the accepted path; `finish` at the end.
A drafter keeps per-request state in `seq.drafter_state[self.name]`, never on itself, so one drafter serves
every request of an Engine, interleaved or not.

Capabilities are data the engine reads instead of asking which method it runs: which target hidden states a
drafter reads (boundary ids, DESIGN.md), whether it reads the final hidden state, whether it emits draft
probabilities or trees, whether its proposals have a fixed block size, whether it needs a draft model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar

from specdecode.errors import SpecDecodeError
from specdecode.spec_types import DraftProposal, Sequence, TargetOutput, VerifyResult

if TYPE_CHECKING:
    import torch

    from specdecode.models.decoder.kv_cache import KVCache
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
    reads_verify_rows: bool = False  # wants every row of each verify forward, rejected ones too (`observe`)


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

    def path_for(self, method: str) -> str | None:
        """The folder method `method` reads its own weights from, or None."""
        return self.draft_path.get(method) if isinstance(self.draft_path, dict) else self.draft_path


def option(default: Any, help: str, llama_cpp: str | None = None, vllm: str | None = None,
           cli: tuple[str, ...] = (), serve_default: Any = None, **bounds: float) -> Any:
    """A drafter option: its default, a help line, and the names llama.cpp's server flags and vLLM's
    `speculative_config` give it (accepted as aliases by our CLI and `--speculative-config`). `serve_default`,
    when set, replaces the default in `specdecode serve` (a server is shared by users who may not see each
    other's data). `bounds` (ge, gt, le, lt) are the values a number takes: checked for every front door
    (check_bounds) and published in the server's request schema."""
    return field(default=default, metadata={"help": help, "llama_cpp": llama_cpp, "vllm": vllm, "cli": cli,
                                            "serve_default": serve_default, "bounds": bounds})


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


class Drafter:
    name: ClassVar[str]
    caps: DrafterCaps = DrafterCaps()  # a class default; an instance may refine it from its weights in create()
    Options: ClassVar[type] = NoOptions
    aliases: ClassVar[tuple[str, ...]] = ()  # other runtimes' method names for it (llama.cpp's --spec-type)
    vllm_method: ClassVar[str | None] = None  # vLLM's speculative_config "method" for it
    tree_options: ClassVar[dict[str, Any]] = {}  # options that make it propose trees (when caps.emits_trees)
    weights_kind: ClassVar[str] = "weights of its own"  # what --draft-head names for it, when caps.draft_files
    auto_rank: ClassVar[int | None] = None  # where `auto` tries it among the drafters found (lower first); None: never
    finds_sources: ClassVar[bool] = False  # it decides what to load before models load (auto.find_sources)

    @classmethod
    def create(cls, resources: DrafterResources, options: Any) -> Drafter:
        return cls()

    @classmethod
    def check_resources(cls, resources: DrafterResources) -> None:
        """Raise SpecDecodeError when what it needs was not loaded or named (a draft model, a folder of its own
        weights), saying which flag gives it; from its capabilities alone, building nothing."""
        if cls.caps.needs_draft_model and resources.draft is None:
            raise SpecDecodeError(f"method '{cls.name}' needs a draft model (--draft-model NAME_OR_PATH)")
        if cls.caps.draft_files and resources.path_for(cls.name) is None:
            raise SpecDecodeError(f"method '{cls.name}' needs {cls.weights_kind}: --draft-model PATH (a folder with "
                                  "config.json and safetensors weights), or --draft-head PATH beside a draft model")

    @classmethod
    def check_options_fit(cls, options: Any, resources: DrafterResources) -> None:
        """Raise SpecDecodeError where one of its options cannot apply to what was loaded (a token count beyond
        the target's vocabulary); from the options and the resources alone, building nothing."""

    def start(self, seq: Sequence, prefill: TargetOutput) -> None:
        """After the target's prefill: `seq.tokens` holds the prompt and the first generated token; `prefill`
        covers the prompt's rows (hidden states at every row, logits at the last)."""

    @classmethod
    def found_for(cls, resources: DrafterResources) -> str | None:
        """For `auto` (drafters/auto.py): what makes this drafter usable with what was loaded, in a few words, or
        None when it cannot draft here."""
        try:
            cls.check_resources(resources)
        except SpecDecodeError:
            return None
        if cls.caps.draft_files:
            return f"{cls.weights_kind} at {resources.path_for(cls.name)}"
        if cls.caps.needs_draft_model:
            return f"draft model {resources.draft.name}"
        return "free to run"

    @classmethod
    def stands_for(cls, resources: DrafterResources) -> list[str] | None:
        """The drafters a combination that drafts nothing itself (`auto`) stands for with these resources; None
        for a drafter that drafts."""
        return None

    def defer_start(self, seq: Sequence) -> bool:
        """Begin a request without reading the prefill, where this drafter can: its first proposal then catches
        up on the whole context (a draft model). A combination whose members may never be chosen asks this
        instead of `start`, so a member it never picks costs nothing; -> whether this drafter deferred."""
        return False

    def pending_tokens(self, seq: Sequence) -> int:
        """Committed tokens this drafter has yet to read before it can propose (a draft model's catch-up)."""
        return 0

    def propose(self, seq: Sequence, budget: int) -> DraftProposal:
        """At most `budget` tokens on any root-to-leaf path (the context and token budget allow no more)."""
        raise NotImplementedError

    def propose_many(self, seqs: list[Sequence], budgets: list[int]) -> list[DraftProposal]:
        """Proposals for the requests of one batched step (a budget of 0: nothing). Each must be what `propose`
        gives that request alone; a drafter whose forwards batch without changing a bit overrides this."""
        return [self.propose(seq, budget) if budget > 0 else DraftProposal.empty(self.name)
                for seq, budget in zip(seqs, budgets)]

    def proposals_for_asked(self, seqs: list[Sequence], budgets: list[int],
                            chains: Callable[[list[Sequence], list[int]], list[DraftProposal]]) -> list[DraftProposal]:
        """For a `propose_many` that batches: `chains(seqs, budgets)` over the sequences asked for tokens (a budget
        above 0), empty proposals for the rest (a chain whose earlier member drafted for them)."""
        proposals = [DraftProposal.empty(self.name) for _ in seqs]
        asked = [b for b, budget in enumerate(budgets) if budget > 0]
        if asked:
            for b, chain in zip(asked, chains([seqs[b] for b in asked], [budgets[b] for b in asked])):
                proposals[b] = chain
        return proposals

    def observe(self, seq: Sequence, fed: torch.Tensor, target: TargetOutput) -> None:
        """For a drafter with caps.reads_verify_rows, before `commit`: every row of the step's verify forward, the
        rejected drafts' included; `fed` [T] the tokens fed (the root, then each proposed node), `target` their
        rows (logits of each)."""

    def commit(self, seq: Sequence, result: VerifyResult, target: TargetOutput) -> None:
        """After `seq.tokens` gained `result.tokens`; `target` holds the verify forward's rows along the accepted
        path (the root, then each accepted node). `result.source` says whose proposal was verified."""

    def finish(self, seq: Sequence) -> None:
        """The request ended: drop its state."""
        seq.drafter_state.pop(self.name, None)

    def parts(self) -> list[Drafter]:
        """The drafters this one is made of: itself, or a combination's members."""
        return [self]

    def max_nodes(self, budget: int) -> int:
        """The most nodes a proposal under `budget` may hold (the KV cache keeps room for them)."""
        return budget

    def token_caches(self, seq: Sequence) -> dict[str, KVCache]:
        """KV caches this drafter keeps of the request's committed tokens, by drafter name (a draft model's; row i
        holds seq.tokens[i]): the prefix cache keeps their rows with the target's, and a later request that
        reuses them finds them in `seq.reused_drafter_rows` as it starts."""
        return {}

    def cache_bytes(self) -> int:
        """Memory held by caches that outlive a request (reported in stats; weights are not counted)."""
        return 0

    def weights_bytes(self) -> int:
        """Memory held by weights of the drafter's own (an EAGLE-3 head); a draft model's are the Engine's."""
        return 0

    def request_bytes(self, seq: Sequence) -> int:
        """Memory this request's state holds in the drafter (a draft model's KV cache), while it runs."""
        return 0
