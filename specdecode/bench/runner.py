"""Run one method over the questions: multi-turn conversations, wall time per question, raw ids and stats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter

from specdecode.bench.datasets import Question
from specdecode.config import SamplingParams, SpecConfig
from specdecode.engine.engine import Engine
from specdecode.engine.stats import GenerationStats, combine
from specdecode.errors import SpecDecodeError


@dataclass
class TurnOutput:
    text: str
    new_tokens: int
    token_ids: list[int] | None = None  # None where a peer's API returns text only
    stats: GenerationStats | None = None  # ours only: what the engine measured
    extra: dict = field(default_factory=dict)  # peer-reported or peer-measured details (ttft, server timings)
    # The answer's own time where the runner's wall time holds more (a fresh process's load); None: the wall time.
    seconds: float | None = None


# One turn of a conversation: messages so far -> the answer.
TurnRunner = Callable[[list[dict]], TurnOutput]


@dataclass
class QuestionResult:
    question_id: str
    category: str
    new_tokens: int = 0
    seconds: float = 0.0  # wall time over all turns, prefill included (in a fresh process: the requests alone)
    token_ids: list[list[int]] | None = field(default_factory=list)  # per turn; None for text-only peers
    stats: GenerationStats | None = None  # ours only: what the engine measured
    error: str | None = None  # what failed on this question; the run goes on
    extra: list[dict] = field(default_factory=list)  # per turn

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class MethodSpec:
    """One column of the benchmark: our engine with a spec, or a peer's method."""

    name: str
    family: str  # "specdecode", "hf" or "openai"
    baseline: str  # the plain-decoding method of the same family, for speedup and identical-output rate
    spec: SpecConfig | None = None  # ours only


def run_question(question: Question, run_turn: TurnRunner) -> QuestionResult:
    result = QuestionResult(question.question_id, question.category)
    messages: list[dict] = []
    turn_stats: list[GenerationStats] = []
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        started = perf_counter()
        try:
            output = run_turn(messages)
        except (SpecDecodeError, RuntimeError, ValueError, OSError) as error:
            # One failed question (a peer's error, a library's) is recorded; the other results still count.
            result.error = f"{type(error).__name__}: {error}"
            return result
        result.seconds += perf_counter() - started if output.seconds is None else output.seconds
        result.new_tokens += output.new_tokens
        result.extra.append(output.extra)
        if output.token_ids is None:
            result.token_ids = None
        elif result.token_ids is not None:
            result.token_ids.append(output.token_ids)
        messages.append({"role": "assistant", "content": output.text})
        if output.stats is not None:
            turn_stats.append(output.stats)
    if turn_stats:
        result.stats = combine(turn_stats, turn_stats[0].method)
    return result


def engine_turn_runner(engine: Engine, spec: SpecConfig, sampling: SamplingParams) -> TurnRunner:
    def run_turn(messages: list[dict]) -> TurnOutput:
        outcome = engine.complete(messages, sampling, spec)
        return TurnOutput(outcome.text, len(outcome.token_ids), outcome.token_ids, outcome.stats)

    return run_turn
