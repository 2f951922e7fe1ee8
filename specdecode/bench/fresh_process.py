"""`specdecode bench --fresh-process`: each of our answers in a new Python process, as a user who runs `specdecode
generate` once per question meets it: load the models, warm up, then the one request.

The bench sends the child (cli/bench_answer.py: loading is the command line's work) one JSON object on standard
input: the command line's model settings, the method's SpecConfig, the SamplingParams and the conversation so far.
It reads one JSON line back: the answer, its token ids, the engine's stats as their fields, and the seconds the
request took alone. Those seconds, not the process's wall time, are the answer's time in the report, so the
speedup compares what `generate` prints; load and warm-up are kept per turn in the results' `extra`
(`load_seconds`, `process_seconds`)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import asdict, dataclass, fields
from time import perf_counter

from specdecode.bench.runner import TurnOutput, TurnRunner
from specdecode.config import SamplingParams, SpecConfig
from specdecode.engine.stats import GenerationStats
from specdecode.errors import SpecDecodeError
from specdecode.spec_types import ChoiceRecord


@dataclass(frozen=True)
class FreshProcess:
    command: tuple[str, ...]  # the child: one request as JSON on stdin -> one answer as a JSON line on stdout
    arguments: dict  # the command line's settings, from which the child loads the same models


def fresh_turn_runner(process: FreshProcess, spec: SpecConfig, sampling: SamplingParams) -> TurnRunner:
    """A turn runner that answers each turn in a process of its own."""
    def run_turn(messages: list[dict]) -> TurnOutput:
        request = {"arguments": process.arguments, "spec": asdict(spec), "sampling": asdict(sampling),
                   "messages": messages}
        began = perf_counter()
        done = subprocess.run(process.command, input=json.dumps(request), capture_output=True, text=True,
                              check=False)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            said = (done.stderr.strip().splitlines() or ["it said nothing"])[-1]
            raise SpecDecodeError(f"the answer's own process failed (exit {done.returncode}): {said}")
        answer = json.loads(lines[-1])
        extra = {"load_seconds": answer["load_seconds"], "process_seconds": round(perf_counter() - began, 3)}
        return TurnOutput(answer["text"], len(answer["token_ids"]), answer["token_ids"],
                          stats_from_fields(answer["stats"]), extra, seconds=answer["seconds"])

    return run_turn


def stats_from_fields(values: dict) -> GenerationStats:
    """The GenerationStats a child sent as its dataclass fields (asdict), per-step choices included."""
    known = {f.name for f in fields(GenerationStats)}
    choices = {member: ChoiceRecord(**record) for member, record in values.get("choices", {}).items()}
    return GenerationStats(**{name: value for name, value in values.items() if name in known} | {"choices": choices})
