"""Run one method over the questions: multi-turn conversations, wall time per question, raw ids and stats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter

from specdecode.bench.datasets import Question
from specdecode.config import SamplingParams, SpecConfig
from specdecode.engine import Engine
from specdecode.stats import GenerationStats, combine

# One turn of a conversation: messages so far -> (answer text, answer token ids, stats or None for peers).
TurnRunner = Callable[[list[dict]], tuple[str, list[int], GenerationStats | None]]


@dataclass
class QuestionResult:
    question_id: str
    category: str
    new_tokens: int = 0
    seconds: float = 0.0  # wall time over all turns, prefill included
    token_ids: list[list[int]] = field(default_factory=list)  # per turn
    stats: GenerationStats | None = None  # ours only: what the engine measured
    error: str | None = None  # a peer that failed on this question; the run goes on

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class MethodSpec:
    """One column of the benchmark: our engine with a spec, or a peer's method."""

    name: str
    family: str  # "specdecode", "hf" or "openai"
    baseline: str  # the plain-decoding method of the same family, for speedup and identical-output rate
    num_draft_tokens: int = 0
    spec: SpecConfig | None = None  # ours only


def run_question(question: Question, run_turn: TurnRunner) -> QuestionResult:
    result = QuestionResult(question.question_id, question.category)
    messages: list[dict] = []
    turn_stats: list[GenerationStats] = []
    for turn in question.turns:
        messages.append({"role": "user", "content": turn})
        started = perf_counter()
        text, ids, stats = run_turn(messages)
        result.seconds += perf_counter() - started
        result.new_tokens += len(ids)
        result.token_ids.append(ids)
        messages.append({"role": "assistant", "content": text})
        if stats is not None:
            turn_stats.append(stats)
    if turn_stats:
        result.stats = combine(turn_stats, turn_stats[0].method)
    return result


def engine_turn_runner(engine: Engine, spec: SpecConfig, sampling: SamplingParams) -> TurnRunner:
    def run_turn(messages: list[dict]) -> tuple[str, list[int], GenerationStats]:
        outcome = engine.complete(messages, sampling, spec)
        return outcome.text, outcome.token_ids, outcome.stats

    return run_turn
