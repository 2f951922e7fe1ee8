"""Two checkouts of specdecode, one run: the same prompts through both, turn by turn, on the same machine state.

Each checkout runs in its own worker process (its own import path, models loaded once); the parent sends one
(prompt, method) at a time to each in turn, alternating which goes first, so drift in the machine's speed
(other jobs, memory bandwidth, thermal state) falls on both alike. Only APIs both checkouts share are used:
`load_model`, `Engine`, `complete`, `SamplingParams`, `SpecConfig(method, num_draft_tokens)`.

Prints per method: mean tokens/s of each checkout (new tokens over wall time, prefill included), the ratio
new/old, mean accepted length, and whether every output was identical between the two; the last line is JSON.

    git worktree add /tmp/old <commit>
    python docs/benchmarks/same_run_ab.py --old /tmp/old --quant int4 --draft-quant int4 --prompts 8

Prompts: the first N of --dataset (default ../shared/data/humaneval/humaneval_specbench_format.jsonl; each
question's first turn), natural end of turn, greedy. Each worker compiles the w4a8 kernel from its own checkout
into its own extensions folder (TORCH_EXTENSIONS_DIR), so that the two builds never overwrite each other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data" / "humaneval" / "humaneval_specbench_format.jsonl"


def worker(args: argparse.Namespace) -> None:
    """Load the default pair once, then answer one JSON request per stdin line."""
    from specdecode import Engine, SamplingParams, SpecConfig, load_model

    target = load_model("qwen2.5-coder-1.5b-instruct", args.dtype, quiet=True, quant=args.quant)
    draft = load_model("qwen2.5-coder-0.5b-instruct", args.dtype, quiet=True, quant=args.draft_quant)
    engine = Engine(target, draft)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        result = engine.complete(request["prompt"], SamplingParams(max_tokens=request["max_tokens"]),
                                 SpecConfig(request["method"], num_draft_tokens=request["k"]))
        print(json.dumps({"token_ids": result.token_ids, "stats": result.stats.to_dict()}), flush=True)


def start_worker(side: str, checkout: Path, args: argparse.Namespace) -> subprocess.Popen:
    extensions = Path(tempfile.gettempdir()) / f"same_run_ab-extensions-{side}-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": str(checkout), "TORCH_EXTENSIONS_DIR": str(extensions)}
    command = [sys.executable, __file__, "--worker", "--dtype", args.dtype, "--quant", args.quant,
               "--draft-quant", args.draft_quant]
    process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(process.stdout.readline())["ready"]
    return process


def ask(process: subprocess.Popen, request: dict) -> dict:
    process.stdin.write(json.dumps(request) + "\n")
    process.stdin.flush()
    return json.loads(process.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="the other checkout (e.g. a git worktree of the previous commit)")
    parser.add_argument("--new", type=Path, default=ROOT)
    parser.add_argument("--methods", default="none,ngram,draft,ngram+draft", help="'+' chains methods")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--dataset", type=Path, default=DATA, help="Spec-Bench jsonl; each first turn a prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quant", default="none")
    parser.add_argument("--draft-quant", default="int4")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    prompts = [json.loads(line)["turns"][0] for line in args.dataset.read_text().splitlines()[: args.prompts]]
    methods = [m.replace("+", ",") for m in args.methods.split(",")]
    workers = {side: start_worker(side, checkout, args) for side, checkout in (("old", args.old), ("new", args.new))}
    for process in workers.values():  # warm-up: first-call costs are not timed
        ask(process, {"prompt": prompts[0], "method": "ngram,draft", "k": args.k, "max_tokens": 8})
    runs: dict[tuple[str, str], list[dict]] = {(m, side): [] for m in methods for side in workers}
    for index, prompt in enumerate(prompts):
        for method in methods:
            order = ["old", "new"] if index % 2 == 0 else ["new", "old"]
            for side in order:
                runs[(method, side)].append(ask(workers[side], {"prompt": prompt, "method": method, "k": args.k,
                                                                "max_tokens": args.max_tokens}))
        print(f"prompt {index + 1}/{len(prompts)} done", file=sys.stderr)
    for process in workers.values():
        process.stdin.close()
        process.wait()

    summary = {}
    print(f"{'method':14} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8} {'accepted len':>13} identical")
    for method in methods:
        old, new = runs[(method, "old")], runs[(method, "new")]
        old_speed = mean(r["stats"]["tokens_per_second"] for r in old)
        new_speed = mean(r["stats"]["tokens_per_second"] for r in new)
        length = mean(r["stats"]["mean_accepted_length"] for r in new)
        identical = all(a["token_ids"] == b["token_ids"] for a, b in zip(old, new))
        summary[method] = {"old": round(old_speed, 3), "new": round(new_speed, 3),
                           "ratio": round(new_speed / old_speed, 4), "mean_accepted_length": round(length, 3),
                           "identical": identical}
        print(f"{method:14} {old_speed:10.2f} {new_speed:10.2f} {new_speed / old_speed:8.3f} {length:13.2f} "
              f"{identical}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
