"""Frozen settings: what to sample and how to speculate. Each value is checked here on its own (types, ranges);
what needs the drafter registry (method names, each drafter's options, the relaxed rule) is checked where the
registry lives, by drafters.registry.resolve_spec, which every front door and the Engine call."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from specdecode.errors import SpecDecodeError, quoted

MAX_DRAFT_TOKENS = 64
# How sampled drafts are verified: coupled (each position's randomness fixed by the seed, acceptance/noise.py: the
# output is plain decoding's at that seed, token for token), block (a chain jointly, block_verify.py) or token-wise.
VERIFICATION_RULES = ("coupled", "block", "token")
# The rule of a request whose SpecConfig names none, by whether its SamplingParams carry a seed. The one place this
# default is decided: "coupled" for both makes every sampled answer reproducible from the seed the Engine reports
# (docs/benchmarks/block_verification.py measures what each rule accepts).
DEFAULT_VERIFICATION = {"seeded": "coupled", "unseeded": "block"}
COMBINE_RULES = ("first", "best")  # how a combination of methods picks each step's proposal
MAX_LOGPROBS = 20  # alternatives per token, OpenAI's cap
# Below this, dividing logits by the temperature overflows float32 softmax into NaN; such a temperature means
# greedy anyway (every other token's probability underflows to zero).
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    max_tokens: int = 256
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # None = off; N = each emitted token's log-probability under the target plus its N most likely
    # alternatives (0 to MAX_LOGPROBS), as OpenAI's logprobs / top_logprobs.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, (str, list)):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        self._check_types()
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecDecodeError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SpecDecodeError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SpecDecodeError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise SpecDecodeError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SpecDecodeError(f"seed must be in [0, 2^63), got {self.seed}")
        if self.max_tokens < 1:
            raise SpecDecodeError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise SpecDecodeError("stop strings must not be empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise SpecDecodeError(f"logprobs must be between 0 and {MAX_LOGPROBS} (None = off), got {self.logprobs}")

    def _check_types(self) -> None:
        """Wrong types fail here with the field's name, not deep in the sampler with a TypeError."""
        expected = {"temperature": "number", "top_p": "number", "min_p": "number", "top_k": "int",
                    "max_tokens": "int", "seed": "int or None", "logprobs": "int or None", "ignore_eos": "bool"}
        for name, kind in expected.items():
            value = getattr(self, name)
            if kind == "bool":
                fits = isinstance(value, bool)
            elif value is None:
                fits = kind.endswith("or None")
            else:
                allowed = (int, float) if kind == "number" else int
                fits = isinstance(value, allowed) and not isinstance(value, bool)
            if not fits:
                raise SpecDecodeError(f"{name} must be {'an' if kind.startswith('int') else 'a'} {kind}, got {value!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise SpecDecodeError(f"stop must be a string or a list of strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True, init=False)
class SpecConfig:
    """How to speculate: a method (a drafter name, or a comma-separated combination such as 'ngram,draft'), the
    draft length, and each drafter's own options by name (declared in its file, e.g. ngram_max=3). `guard`
    pauses drafting while it measures slower than plain decoding (engine/speed_guard.py). `combine` is how a
    combination picks each step's proposal: "first" (llama.cpp's rule, the first member with one) or "best" (the
    most expected tokens per second, drafters/step_choice.py). `relaxed` opts into lossy acceptance
    (acceptance/relaxed.py). `verification` is how sampled drafts are verified: "coupled" (each position's
    randomness fixed by the seed: the output is plain decoding's at that seed, token for token, whatever was
    drafted), "block" (a chain jointly, Sun et al. 2025, acceptance/block_verify.py) or "token" (token by token);
    all are lossless, and greedy decoding is verified the same under each. None (the default) picks by the seed:
    DEFAULT_VERIFICATION.

        SpecConfig("ngram,draft", num_draft_tokens=5, ngram_max=3, draft_p_min=0.8)
    """

    method: str
    num_draft_tokens: int
    adaptive: bool
    options: tuple[tuple[str, Any], ...]  # (option name, value), sorted by name; unset options keep defaults
    guard: bool
    combine: str
    relaxed: str | None  # opt-in lossy acceptance, "RULE:VALUE" (relaxed.py); None = exact, lossless
    verification: str | None  # one of VERIFICATION_RULES; None = DEFAULT_VERIFICATION, by the seed

    def __init__(self, method: str = "none", num_draft_tokens: int = 3, adaptive: bool = True,
                 options: Iterable[tuple[str, Any]] | Mapping[str, Any] = (), guard: bool = True,
                 combine: str = "first", relaxed: str | None = None, verification: str | None = None,
                 **named_options: Any):
        if (not isinstance(method, str) or type(num_draft_tokens) is not int or not isinstance(adaptive, bool)
                or not isinstance(guard, bool)):
            raise SpecDecodeError(f"SpecConfig takes a method name (str), num_draft_tokens (int), adaptive and "
                                  f"guard (bool), got {method!r}, {num_draft_tokens!r}, {adaptive!r}, {guard!r}")
        merged = dict(options.items() if isinstance(options, Mapping) else options) | named_options
        members = [m.strip() for m in method.split(",")]
        if len(members) > 1 and not all(members):  # "ngram," or "ngram,,draft": a member left out, not nothing
            raise SpecDecodeError(f"method {quoted(method)} has an empty member: name each method of a combination "
                                  "once, separated by single commas, such as 'ngram,draft'")
        object.__setattr__(self, "method", ",".join(members))
        object.__setattr__(self, "num_draft_tokens", num_draft_tokens)
        object.__setattr__(self, "adaptive", adaptive)
        object.__setattr__(self, "options", tuple(sorted(merged.items())))
        object.__setattr__(self, "guard", guard)
        object.__setattr__(self, "combine", combine)
        if relaxed is not None and not isinstance(relaxed, str):
            raise SpecDecodeError(f"relaxed must be a string such as 'typical' or 'threshold:0.3', got {relaxed!r}")
        object.__setattr__(self, "relaxed", relaxed)
        object.__setattr__(self, "verification", verification)
        if verification is not None and verification not in VERIFICATION_RULES:
            raise SpecDecodeError(f"verification must be one of {', '.join(VERIFICATION_RULES)} (None: by the seed), "
                                  f"got {verification!r}")
        if combine not in COMBINE_RULES:
            raise SpecDecodeError(f"combine must be one of {', '.join(COMBINE_RULES)}, got {combine!r}")
        if not 0 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise SpecDecodeError(
                f"num_draft_tokens must be between 0 and {MAX_DRAFT_TOKENS}, got {self.num_draft_tokens}"
            )

    @property
    def lossless(self) -> bool:
        return self.relaxed is None

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(m for m in self.method.split(",") if m)

    def verification_for(self, sampling: SamplingParams) -> str:
        """The rule a request with `sampling` is verified by: the one named, else DEFAULT_VERIFICATION's for a
        request with or without a seed."""
        if self.verification is not None:
            return self.verification
        return DEFAULT_VERIFICATION["seeded" if sampling.seed is not None else "unseeded"]

    def option(self, name: str, default: Any = None) -> Any:
        """A drafter option's value as given here (`default` when it was not set)."""
        return dict(self.options).get(name, default)
