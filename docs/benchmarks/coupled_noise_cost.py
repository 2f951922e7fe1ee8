"""What the coupled rule's noise costs per position, against a plain decoding step and against today's sampler.

The coupled rule computes one row of race weights over the whole vocabulary per position (acceptance/noise.py), once
per generated token (a row is kept while its position is pending, so drafting and verification share it), and picks a
token with one product and an argmax. The token-wise and block rules draw each token with torch.multinomial over
the same row instead (one per draft token and one per step). Prints milliseconds per position for each, and, with a
model, a plain decoding step's milliseconds (median of --steps) and the noise's share of it; the last line is JSON.

    python docs/benchmarks/coupled_noise_cost.py                 # the default target (w4a8), its vocabulary
    python docs/benchmarks/coupled_noise_cost.py --vocab 151936  # the noise alone, no model loaded
"""

from __future__ import annotations

import argparse
import json
from statistics import median
from time import perf_counter

import torch

from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.acceptance.noise import PositionNoise, coupled_tokens
from specdecode.models.formats.default_models import DEFAULT_TARGET


def milliseconds(work, repeats: int) -> float:
    """Median wall milliseconds of `work()` over `repeats` calls, after one warm-up call."""
    work()
    times = []
    for _ in range(repeats):
        began = perf_counter()
        work()
        times.append(perf_counter() - began)
    return 1000 * median(times)


def plain_step_ms(model_name: str, quant: str, steps: int) -> tuple[float, int]:
    """A plain decoding step's median milliseconds on `model_name` (greedy, so no sampler is in it), and its
    vocabulary."""
    target = load_model(model_name, quant=quant)
    engine = Engine(target, spec=SpecConfig("none"))
    request = engine.begin(engine.encode("Write a Python function that reverses a string."),
                           SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    engine.prefill(request)
    times = []
    while request.finish_reason is None:
        began = perf_counter()
        engine.step(request)
        times.append(perf_counter() - began)
    engine.finish(request)
    return 1000 * median(times), target.config.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--quant", default="w4a8")
    parser.add_argument("--vocab", type=int, help="measure the noise alone over this many tokens (no model)")
    parser.add_argument("--steps", type=int, default=32, help="plain steps timed")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    step_ms, vocab = (None, args.vocab) if args.vocab else plain_step_ms(args.target, args.quant, args.steps)
    p = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(0)), dim=-1)  # [V]
    positions = iter(range(10**9))
    noise = PositionNoise(seed=1, vocab=vocab, device="cpu")
    report = {"vocab": vocab, "threads": torch.get_num_threads(),
              "noise_row_ms": milliseconds(lambda: noise.rows([next(positions)]), args.repeats),
              "coupled_choice_ms": milliseconds(lambda: coupled_tokens(p, noise.rows([0])[0]), args.repeats),
              "multinomial_ms": milliseconds(lambda: torch.multinomial(p, 1), args.repeats)}
    if step_ms is not None:
        report |= {"plain_step_ms": step_ms, "noise_share_of_step": report["noise_row_ms"] / step_ms}
    print(f"vocabulary {vocab}, {report['threads']} threads: noise row {report['noise_row_ms']:.3f} ms per position, "
          f"coupled choice {report['coupled_choice_ms']:.3f} ms, torch.multinomial {report['multinomial_ms']:.3f} ms"
          + ("" if step_ms is None else f"; a plain step {step_ms:.1f} ms, so the noise is "
             f"{report['noise_share_of_step']:.1%} of it"))
    print(json.dumps({key: round(value, 4) if isinstance(value, float) else value for key, value in report.items()}))


if __name__ == "__main__":
    main()
