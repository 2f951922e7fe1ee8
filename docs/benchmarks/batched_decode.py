"""Batched steps on the default pair (w4a8): aggregate decoding tokens/s with N requests stepped together.

Run from the repository root (about 12 minutes on 2 cores):

    python docs/benchmarks/batched_decode.py [--prompts 16] [--max-tokens 128] [--methods "none;ngram;ngram,draft;auto"]
        [--draft-head "eagle3=PATH,mtp=PATH"] [--draft-quant w4a8]

The same prompts (HumanEval's first N, chat template, greedy, natural ends of turn) go through N slots as the
server's batched scheduler runs them: N requests step together in Engine.step_many, and a finished one's slot
takes the next prompt. Decoding time is the steps' time; each request's prefill runs alone as it is admitted
and is reported apart. N = 1 is also what interleaving (`--batching off`) reaches at any load: one request's
step at a time. Every output is checked equal to the request decoded alone. A method written `METHOD/one-by-one`
runs with its drafter proposing for one request at a time (the protocol's default `propose_many`), which is what
shared drafting forwards save against. Each (method, slots) run has a fresh Engine over the same loaded models, so
nothing learnt in an earlier run carries over: not the speed guard's or the load budget's estimates, and above
all not suffix decoding's cache, which would hold the same prompts' earlier answers and draft them whole.

`--forward-costs` instead times one target forward of B sequences x 1 new row each (600 cached tokens apiece,
median of 5) for B = 1, 2, 4, 8, 16: what a plain batched step costs by batch size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
from batched_runs import admit, step_active  # noqa: E402 - the tests' batched driver, as the server steps
from plain_vs_llamacpp import spec_for  # noqa: E402 - "auto" as generate resolves it for the default pair

from specdecode import Engine, SamplingParams, SpecConfig  # noqa: E402
from specdecode.bench.datasets import load_questions  # noqa: E402
from specdecode.drafters.base import Drafter  # noqa: E402
from specdecode.models.decoder.kv_cache import CacheBatch  # noqa: E402
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402
from specdecode.models.loader import load_model  # noqa: E402

DATASET = "../shared/data/humaneval/humaneval_specbench_format.jsonl"


def run_slots(engine: Engine, prompts: list[str], sampling: SamplingParams, spec: SpecConfig, slots: int):
    """-> (generated ids per prompt, decoding seconds (steps and their events), prefill seconds)."""
    outputs: list[list[int]] = [[] for _ in prompts]
    waiting, active = list(range(len(prompts))), []
    decode = prefill = 0.0
    while waiting or active:
        while waiting and len(active) < slots:
            index = waiting.pop(0)
            began = time.perf_counter()
            admit(engine, index, (prompts[index], sampling, spec), active, outputs)
            prefill += time.perf_counter() - began
        if active:
            began = time.perf_counter()
            step_active(engine, active, outputs)
            decode += time.perf_counter() - began
    return outputs, decode, prefill


@contextmanager
def one_by_one(drafter: Drafter, wanted: bool):
    """While active, `drafter` and the members of a chain propose for one request at a time."""
    drafters = [drafter, *getattr(drafter, "members", [])] if wanted else []
    for each in drafters:
        each.propose_many = partial(Drafter.propose_many, each)
    try:
        yield
    finally:
        for each in drafters:
            del each.propose_many


@torch.inference_mode()
def forward_costs(engine: Engine, context: int = 600) -> None:
    model = engine.target.model
    prompt = torch.randint(0, 1000, (1, context))  # [1, C]
    print("| sequences x 1 row | forward ms | rows/s |")
    print("|---|---|---|")
    for batch in (1, 2, 4, 8, 16):
        caches = [model.new_cache(context + 1) for _ in range(batch)]
        for cache in caches:
            model(prompt, torch.arange(context).unsqueeze(0), cache)
        times = []
        for _ in range(5):
            for cache in caches:
                cache.truncate(context)
            began = time.perf_counter()
            model(torch.randint(0, 1000, (batch, 1)), torch.full((batch, 1), context), CacheBatch(caches))
            times.append(time.perf_counter() - began)
        seconds = statistics.median(times)
        print(f"| {batch} | {1000 * seconds:.1f} | {batch / seconds:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default="none;ngram;ngram,draft", help="';' between methods")
    parser.add_argument("--slots", default="1,2,4,8,16")
    parser.add_argument("--forward-costs", action="store_true", help="time plain batched forwards instead")
    parser.add_argument("--draft-head", help="METHOD=PATH,...: the weights of eagle3, mtp (a companion file) ...")
    parser.add_argument("--draft-quant", default="w4a8",
                        help="what the draft model's and those drafters' own weights run as")
    args = parser.parse_args()
    heads = dict(item.split("=", 1) for item in args.draft_head.split(",")) if args.draft_head else None
    engine = Engine(load_model(DEFAULT_TARGET, quiet=True, quant="auto"),
                    # As the command line's --draft-quant auto: the default draft's GGUF is mostly Q5_0 (rows of
                    # 896 do not split into Q4_K's 256), which load_model's quant="auto" keeps in float.
                    load_model(DEFAULT_DRAFT, quiet=True, quant=args.draft_quant),
                    draft_path=heads, draft_quant=args.draft_quant)
    if args.forward_costs:
        forward_costs(engine)
        return
    prompts = [q.turns[0] for q in load_questions([DATASET], args.prompts)]
    sampling = SamplingParams(max_tokens=args.max_tokens)
    engine.complete(prompts[0], SamplingParams(max_tokens=8))  # warm-up
    print("| method | slots | decode tokens/s | vs 1 slot | prefill s | identical to alone |")
    print("|---|---|---|---|---|---|")
    for method in args.methods.split(";"):
        name, _, mode = method.partition("/")
        spec = spec_for(name)
        alone = None
        for slots in [int(n) for n in args.slots.split(",")]:
            fresh = Engine(engine.target, engine.draft, draft_path=heads, draft_quant=args.draft_quant)
            with one_by_one(fresh.drafter(spec), mode == "one-by-one"):
                outputs, decode, prefill = run_slots(fresh, prompts, sampling, spec, slots)
            tokens = sum(len(ids) - 1 for ids in outputs)  # the first token of each comes from its prefill
            rate = tokens / decode
            alone = alone or (outputs, rate)
            same = sum(a == b for a, b in zip(outputs, alone[0]))
            print(f"| {method} | {slots} | {rate:.1f} | {rate / alone[1]:.2f}x | {prefill:.1f} | "
                  f"{same}/{len(prompts)} |", flush=True)


if __name__ == "__main__":
    main()
