"""What logprobs cost speculative decoding: tokens/s with and without them, same engine, same prompts.

Run from the repository root: PYTHONPATH=. python docs/benchmarks/logprobs_speed.py

Part 1: the suite's tiny Qwen2 pair (tests/conftest.py), greedy, up to 400 new tokens per run (natural ends;
the random tiny model does not write its end token within them on this prompt), every method with
logprobs off, 0 (the chosen token's only) and 20 alternatives, rounds interleaved, median of 5. Part 2: the
per-step cost of token_logprobs alone on rows of the default target's vocabulary (151,936), which is what the
tiny model's 272-token vocabulary cannot show.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
from conftest import save_tiny_model  # noqa: E402 - the tests' tiny model builder

from specdecode import Engine, SamplingParams, SpecConfig  # noqa: E402
from specdecode.acceptance.logprobs import token_logprobs  # noqa: E402
from specdecode.models.loader import load_model  # noqa: E402

METHODS = ["none", "ngram", "draft", "ngram,draft"]
SETTINGS = {"off": None, "logprobs=0": 0, "logprobs=20": 20}
ROUNDS = 5


def tiny_pair(root: Path):
    long = {"max_position_embeddings": 4096}
    target = load_model(save_tiny_model(root / "t", "qwen2", scale=0.15, **long), dtype="float32")
    draft = load_model(save_tiny_model(root / "d", "qwen2", scale=0.15, noise=0.01, **long), dtype="float32")
    return Engine(target, draft)


def engine_rates(engine: Engine) -> None:
    times = {(m, s): [] for m in METHODS for s in SETTINGS}
    for _ in range(ROUNDS):
        for method in METHODS:
            for name, logprobs in SETTINGS.items():
                sampling = SamplingParams(max_tokens=400, logprobs=logprobs)
                result = engine.complete("abcabc hello hello abc", sampling, SpecConfig(method), raw=True)
                times[method, name].append(result.stats.tokens_per_second)
    print("| method | " + " | ".join(f"{name} tokens/s" for name in SETTINGS) + " |")
    print("|---|" + "---|" * len(SETTINGS))
    for method in METHODS:
        rates = [statistics.median(times[method, name]) for name in SETTINGS]
        print(f"| {method} | " + " | ".join(f"{r:.0f} ({r / rates[0]:.2f}x)" for r in rates) + " |")


def per_step_cost() -> None:
    for rows in (1, 4):
        logits = torch.randn(rows, 151_936)
        for top in (0, 20):
            token_logprobs(logits, [0] * rows, top)  # warm-up
            began = time.perf_counter()
            for _ in range(50):
                token_logprobs(logits, [0] * rows, top)
            print(f"token_logprobs, {rows} rows of 151,936, top {top}: {(time.perf_counter() - began) / 50 * 1e3:.2f} ms")


if __name__ == "__main__":
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as scratch:
        engine_rates(tiny_pair(Path(scratch)))
    per_step_cost()
