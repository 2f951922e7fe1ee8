"""CPU decoding of the default pair in bf16, int8 and int4: speed, bytes per token, verify cost, draft precision.

Run from the repository root (takes about 10 minutes on 2 cores):

    python docs/benchmarks/cpu_decode.py [--prompts 3] [--max-tokens 128] [--json out.json]

Greedy, first N HumanEval prompts from ../shared/data, decode-only tokens/s (prefill excluded). Every number
is measured in this one run, so ratios between rows are fair; absolute tokens/s depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET

PROMPTS = Path("../shared/data/humaneval/humaneval_specbench_format.jsonl")
QUANTS = ("none", "int8", "int4")
VERIFY_ROWS = (1, 2, 4, 8, 16)


def streamed_bytes(model: nn.Module) -> int:
    """Bytes of weight read per decode step: every linear layer and the head; the embedding is only indexed."""
    total = 0
    for name, module in model.named_modules():
        if module is model or name == "embed" or list(module.children()):
            continue
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        tensors += [t for t in vars(module).values() if isinstance(t, torch.Tensor)]  # prepacked weights
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def decode_speed(engine: Engine, prompts: list[str], sampling: SamplingParams, spec: SpecConfig) -> dict:
    tokens = seconds = accepted = drafted = 0
    for prompt in prompts:
        stats = engine.complete(prompt, sampling, spec).stats
        tokens += stats.new_tokens - 1  # the first token comes from prefill
        seconds += stats.total_seconds - stats.prefill_seconds
        accepted += stats.accepted_tokens
        drafted += stats.drafted_tokens
    return {"tokens_per_second": tokens / seconds, "acceptance": accepted / drafted if drafted else None}


@torch.inference_mode()
def verify_cost(model: nn.Module, context: int = 200, repeats: int = 20) -> dict[int, float]:
    """Milliseconds of one forward over M new tokens after `context` cached ones (M = 1 is a decode step)."""
    cache = model.new_cache(context + max(VERIFY_ROWS))
    model(torch.arange(context).unsqueeze(0) % 1000, torch.arange(context).unsqueeze(0), cache)
    costs = {}
    for rows in VERIFY_ROWS:
        tokens = torch.full((1, rows), 7)  # [1, M]
        positions = torch.arange(context, context + rows).unsqueeze(0)  # [1, M]
        for _ in range(3):
            model(tokens, positions, cache)
            cache.truncate(context)
        start = time.perf_counter()
        for _ in range(repeats):
            model(tokens, positions, cache)
            cache.truncate(context)
        costs[rows] = (time.perf_counter() - start) / repeats * 1000
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    prompts = [json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines()[: args.prompts]]
    sampling = SamplingParams(max_tokens=args.max_tokens)
    warm = SamplingParams(max_tokens=8)
    results: dict = {"threads": torch.get_num_threads(), "plain": [], "draft": []}

    print("| model | weights | load s | MB/token | decode tok/s | GB/s | forward ms, M = " +
          " / ".join(map(str, VERIFY_ROWS)) + " |\n|---|---|---|---|---|---|---|", flush=True)
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        for quant in QUANTS:
            start = time.perf_counter()
            loaded = load_model(name, quiet=True, quant=quant)
            load_seconds = time.perf_counter() - start
            engine = Engine(loaded)
            engine.complete(prompts[0], warm, SpecConfig("none"))
            speed = decode_speed(engine, prompts, sampling, SpecConfig("none"))["tokens_per_second"]
            megabytes = streamed_bytes(loaded.model) / 1e6
            costs = verify_cost(loaded.model)
            row = {"model": name, "quant": quant, "load_seconds": load_seconds, "mb_per_token": megabytes,
                   "tokens_per_second": speed, "forward_ms": costs}
            results["plain"].append(row)
            print(f"| {name} | {quant} | {load_seconds:.1f} | {megabytes:.0f} | {speed:.2f} | "
                  f"{megabytes * speed / 1e3:.1f} | {' / '.join(f'{c:.1f}' for c in costs.values())} |", flush=True)
            del loaded, engine

    print("\n| target | draft | plain tok/s | draft tok/s | speedup | acceptance |\n|---|---|---|---|---|---|",
          flush=True)
    for target_quant in ("none", "int4"):
        target = load_model(DEFAULT_TARGET, quiet=True, quant=target_quant)
        plain = None
        for draft_quant in QUANTS:
            engine = Engine(target, load_model(DEFAULT_DRAFT, quiet=True, quant=draft_quant))
            engine.complete(prompts[0], warm, SpecConfig("draft"))
            if plain is None:
                plain = decode_speed(engine, prompts, sampling, SpecConfig("none"))["tokens_per_second"]
            spec = decode_speed(engine, prompts, sampling, SpecConfig("draft"))
            row = {"target_quant": target_quant, "draft_quant": draft_quant, "plain_tokens_per_second": plain,
                   "draft_tokens_per_second": spec["tokens_per_second"], "acceptance": spec["acceptance"]}
            results["draft"].append(row)
            print(f"| {target_quant} | {draft_quant} | {plain:.2f} | {spec['tokens_per_second']:.2f} | "
                  f"{spec['tokens_per_second'] / plain:.2f}x | {spec['acceptance']:.1%} |", flush=True)
        del target
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
