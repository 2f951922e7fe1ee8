"""`draft` and `auto` on one prompt, in turns, each run on a new Engine over the same loaded models (as the bench's
runners are): how long each step's target forward took, and how long the step's commit (acceptance, every member's
commit, per-step choice's bookkeeping), both of which the stats count as verify time.

    python docs/benchmarks/verify_split.py [--rounds 4] [--dataset FILE] [--index 0] [--dtype bfloat16 --quant none]

Each Engine warms up for its method as the bench's do, then answers the prompt (greedy, natural end, 256 new
tokens at most); the order alternates each round, so the machine's drift falls on both. Prints per run the target
forwards, the forward's and the commit's milliseconds per step and the answer's seconds, then the means.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from statistics import mean

import specdecode.engine.engine as engine_module
from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "humaneval" / "humaneval_specbench_format.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dataset", type=Path, default=DATA)
    parser.add_argument("--index", type=int, default=0, help="which line of the dataset (its first turn)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quant", default="none")
    parser.add_argument("--draft-quant", default="w4a8")
    args = parser.parse_args()
    prompt = json.loads(args.dataset.read_text().splitlines()[args.index])["turns"][0]
    target = load_model(DEFAULT_TARGET, args.dtype, quiet=True, quant=args.quant)
    draft = load_model(DEFAULT_DRAFT, args.dtype, quiet=True, quant=args.draft_quant)

    spent = {"forward": 0.0, "commit": 0.0}  # seconds in the current run

    def timed(function, part: str):
        def wrapper(*args, **kwargs):
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - began
        return wrapper

    engine_module.verify_forwards = timed(engine_module.verify_forwards, "forward")
    engine_module.Engine._commit = timed(engine_module.Engine._commit, "commit")  # a method: bound as before
    runs: dict[str, list[tuple[int, float, float, float]]] = {}
    for round_index in range(args.rounds):
        for name in ("draft", "auto") if round_index % 2 == 0 else ("auto", "draft"):
            spec = SpecConfig(name)
            engine = Engine(target, draft, SpecConfig("none"))
            engine.warm_up(spec)
            spent.update(forward=0.0, commit=0.0)
            stats = engine.complete(prompt, SamplingParams(max_tokens=256), spec).stats
            steps = stats.target_forwards
            runs.setdefault(name, []).append((steps, 1000 * spent["forward"] / steps, 1000 * spent["commit"] / steps,
                                              stats.total_seconds))
            print(f"{name} ({stats.method}): {steps} forwards, forward {runs[name][-1][1]:.1f} ms, commit "
                  f"{runs[name][-1][2]:.2f} ms a step, answer {stats.total_seconds:.2f} s", flush=True)
    for name, rows in runs.items():
        print(f"{name} mean: {mean(r[0] for r in rows):.1f} forwards, forward {mean(r[1] for r in rows):.1f} ms, "
              f"commit {mean(r[2] for r in rows):.2f} ms a step, answer {mean(r[3] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
