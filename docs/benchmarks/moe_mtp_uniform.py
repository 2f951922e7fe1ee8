"""MTP drafting on a mixture-of-experts target whose router spreads rows evenly (random weights), against plain
decoding in the same run: the worst case for a verify forward's expert union, where every drafted row adds about
k experts to read.

    python docs/benchmarks/moe_mtp_uniform.py --llama-bin DIR [--layers 2] [--rounds 3] --out DIR

The file: GLM-4.5-Air's widths (hidden 4096, 128 experts, top-8, expert width 1408, one shared expert, the first
layer dense), its first --layers layers and one MTP layer after them, random weights written in llama.cpp's glm4moe
layout and quantized by llama.cpp's own `llama-quantize ... Q4_K_M` (moe_vs_llamacpp.py writes it; DIR as there).
No weights of the model can be had offline. Random weights route evenly and the random MTP layer's drafts are
almost never accepted, so speculation cannot pay here: what is measured is what it costs, each method in turn
with plain decoding in every round:
- `mtp` as a user runs it (the speed guard on; on a mixture of experts also per-step choice, which prices a draft
  by the distinct experts its rows read: drafters/verify_cost.py);
- `mtp` with the guard off and a fixed draft of 3, the naive speculation that papers measure below plain;
- `auto` (the MTP layer and suffix lookups under per-step choice), with the depth it chose for each member.
Random weights fall into loops of repeated tokens, which suffix lookups draft well: `auto`'s gain is theirs.
Plain decoding run a second time in each turn gives the noise floor of a ratio on this machine.
Greedy, --tokens new tokens past end of sequence (random weights have no natural end), token-id prompts; every
output compared with plain decoding's. With only --layers of 46 layers the MTP layer costs about as much as the
trunk it drafts for; in the whole model it is one layer of 47.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_files import write_report
from moe_vs_llamacpp import quantized_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

SHAPE = "glm-4.5-air"
METHODS = {"none (plain again: the noise floor)": {"method": "none"},
           "mtp": {"method": "mtp"},
           "mtp, no guard, 3 drafts": {"method": "mtp", "num_draft_tokens": 3, "guard": False, "adaptive": False},
           "auto": {"method": "auto"}}


def resident() -> dict[str, float]:
    """This process's resident memory in GiB: its own allocations (anon) and pages of mapped files (file)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key[3:].lower()] = int(value.split()[0]) / 2**20
    return fields


def prompts(count: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(1000, vocab, (48,), generator=generator).tolist() for _ in range(count)]


def run(engine, prompt: list[int], tokens: int, spec) -> dict:
    from specdecode import SamplingParams

    began = time.perf_counter()
    result = engine.complete(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), spec)
    stats = result.stats
    decode = stats.total_seconds - stats.prefill_seconds  # the generation phase: prefill is the same for all
    return {"ids": result.token_ids, "tokens_per_second": len(result.token_ids) / decode,
            "wall": time.perf_counter() - began, "drafted": stats.drafted_tokens, "accepted": stats.accepted_tokens,
            "drafting_steps": stats.drafting_steps, "forwards": stats.target_forwards,
            "without_draft": dict(stats.steps_without_draft), "pauses": stats.guard_pauses,
            "choices": {name: record.to_dict() for name, record in stats.choices.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-quantize")
    parser.add_argument("--layers", type=int, default=2, help="trunk layers the file holds (the MTP layer after)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/specdecode-moe"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from specdecode import Engine, SamplingParams, SpecConfig, load_model

    model_file = quantized_file(SHAPE, args.layers, args.work, args.llama_bin, mtp=1)
    loaded = load_model(model_file, dtype="auto", quant="auto")
    config = loaded.config
    assert config.mtp_layers == 1, "the file's MTP layer was not read"
    memory = {"after load": resident()}
    engine = Engine(loaded)
    engine.complete([300] * 8, SamplingParams(max_tokens=8, ignore_eos=True))  # warm up
    specs = {name: SpecConfig(**options) for name, options in METHODS.items()}
    for spec in specs.values():  # built before any timing: the MTP drafter's reduced head takes seconds to make
        engine.drafter(spec)
    texts = prompts(args.prompts, config.vocab_size)
    rows: dict[str, list[dict]] = {name: [] for name in ["plain", *specs]}
    for round_ in range(args.rounds):
        for i, prompt in enumerate(texts):
            plain = run(engine, prompt, args.tokens, SpecConfig("none"))
            rows["plain"].append(plain)
            for name, spec in specs.items():  # in turns with plain: drift in the machine falls on both
                result = run(engine, prompt, args.tokens, spec)
                result["ratio"] = result["tokens_per_second"] / plain["tokens_per_second"]
                result["identical"] = result["ids"] == plain["ids"]
                rows[name].append(result)
                print(f"round {round_ + 1} prompt {i + 1} {name}: {result['ratio']:.3f}x plain, "
                      f"{result['accepted']}/{result['drafted']} accepted, identical {result['identical']}",
                      flush=True)
    memory["after the runs"] = resident()
    summary = {}
    for name in specs:
        results = rows[name]
        ratios = [r["ratio"] for r in results]
        depths = {}
        for r in results:
            for member, choice in r["choices"].items():
                if choice["steps"]:
                    depths.setdefault(member, []).append((choice["steps"], choice["mean_draft_depth"]))
        summary[name] = {
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "identical": all(r["identical"] for r in results), "drafted": sum(r["drafted"] for r in results),
            "accepted": sum(r["accepted"] for r in results),
            "drafting_share": sum(r["drafting_steps"] for r in results) / sum(r["forwards"] for r in results),
            "mean_draft_length": (sum(r["drafted"] for r in results) / max(1, sum(r["drafting_steps"] for r in results))),
            "chosen_depth": {member: sum(s * d for s, d in pairs) / sum(s for s, _ in pairs)
                             for member, pairs in depths.items()},
            "chosen_steps": {member: sum(s for s, _ in pairs) for member, pairs in depths.items()},
        }
    plain_speed = statistics.median(r["tokens_per_second"] for r in rows["plain"])
    result = {"shape": SHAPE, "layers": args.layers, "mtp_layers": 1, "file": model_file.name,
              "bytes": model_file.stat().st_size, "our_quant": loaded.quant, "threads": torch.get_num_threads(),
              "tokens": args.tokens, "prompts": args.prompts, "rounds": args.rounds,
              "plain_tokens_per_second": plain_speed, "resident_gib": memory, "summary": summary, "runs": rows}
    for results in rows.values():
        for r in results:
            r.pop("ids")
    lines = [(f"# MTP on GLM-4.5-Air widths under even routing: {args.layers} of 46 layers and one MTP layer, random "
              f"weights, {model_file.name} ({model_file.stat().st_size / 2**20:.0f} MiB), ours as {loaded.quant}, "
              f"{torch.get_num_threads()} threads"), "",
             (f"Plain decoding: {plain_speed:.2f} tokens/s (median). {args.prompts} prompts x {args.rounds} rounds, "
              f"{args.tokens} tokens each, every method in turn with plain."), "",
             ("| method | x plain (median) | min | max | drafting steps | accepted / drafted | mean draft | chosen "
              "depth by member (steps) | identical |"), "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for name, s in summary.items():
        chosen = ", ".join(f"{member} {depth:.2f} ({s['chosen_steps'][member]})"
                           for member, depth in s["chosen_depth"].items()) or "-"
        lines.append(f"| {name} | {s['ratio_median']:.3f} | {s['ratio_min']:.3f} | {s['ratio_max']:.3f} | "
                     f"{s['drafting_share']:.1%} | {s['accepted']} / {s['drafted']} | {s['mean_draft_length']:.2f} | "
                     f"{chosen} | {'yes' if s['identical'] else 'NO'} |")
    lines += ["", "Resident memory (GiB; a quantized copy read from the cache maps its experts, file pages): " + "; ".join(
        f"{when}: {m['anon']:.2f} own, {m['file']:.2f} mapped" for when, m in memory.items())]
    write_report(args.out, "moe-mtp-uniform", result, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
