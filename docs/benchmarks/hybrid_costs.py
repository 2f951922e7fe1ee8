"""What a Qwen 3.5 (hybrid) target's shape costs here, on random weights (no Qwen 3.5 weights can be had offline):
plain decoding, the verify forward by rows, the cost of keeping each verified row's recurrent state, and of the
rollback itself, all in one run; and the recurrence alone under the two ways to roll back (every row's state
kept, or the last kept and the accepted rows recomputed after a rejection).

    python docs/benchmarks/hybrid_costs.py --shape 0.8b --quant w4a8 --out docs/benchmarks/2026-12-04-hybrid

The 0.8B shape (24 layers, 18 Gated DeltaNet + 6 gated attention, hidden 1024, attention 8 heads / 2 KV of 256,
linear 16 key and 16 value heads of 128, MLP 3584, vocabulary 248,320, tied embeddings) is written once as a
random bf16 folder under --work and loaded like any model (so the w4a8 build is the real one). Times are medians
of --rounds repetitions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_files import save_model_folder, write_report

SHAPES = {
    "0.8b": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
             "head_dim": 256, "intermediate_size": 3584, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
             "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 248320},
    "2b": {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 256, "intermediate_size": 6144, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
           "linear_key_head_dim": 128, "linear_value_head_dim": 128, "vocab_size": 248320},
}


def write_random(folder: Path, shape: dict) -> Path:
    """A random Qwen 3.5 text model of `shape` in bf16 (written once)."""
    if (folder / "config.json").is_file():
        return folder
    from specdecode.models.families import config_from_hf
    from specdecode.models.families.qwen3_5.tensors import hybrid_shapes

    config = {"model_type": "qwen3_5_text", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
              "tie_word_embeddings": True, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
              "eos_token_id": 248046, **shape}
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, dims in hybrid_shapes(config_from_hf(config)).items():
        if name == "lm_head.weight" or "bias" in name and "dt_bias" not in name:
            continue
        if len(dims) == 1:
            tensors[name] = (torch.rand(dims, generator=generator) * 0.2).to(torch.bfloat16)
        else:
            spread = 1.0 / dims[-1] ** 0.5
            tensors[name] = (torch.randn(dims, generator=generator) * spread).to(torch.bfloat16)
    return save_model_folder(folder, config, {f"model.{k}" if not k.startswith("mtp.") else k: v
                                              for k, v in tensors.items()})


def timed(model, prompt: torch.Tensor, rows: int, window: int, rounds: int) -> tuple[float, float]:
    """Median seconds of a forward over `rows` new rows after the prompt, in a cache that keeps the states of
    `window` rows, and of rolling back to the first of them (keep) -> (forward, rollback); each round starts
    from a freshly read prompt, which is not timed."""
    tokens = torch.randint(0, 1000, (1, rows), generator=torch.Generator().manual_seed(rows))
    start = prompt.shape[1]
    forwards, rollbacks = [], []
    for _ in range(rounds):
        cache = model.new_cache(start + rows, rollback_rows=window)
        model(prompt, torch.arange(start).unsqueeze(0), cache)
        began = time.perf_counter()
        model(tokens, torch.arange(start, start + rows).unsqueeze(0), cache)
        forwards.append(time.perf_counter() - began)
        if window > rows:
            began = time.perf_counter()
            cache.keep(start, [0])  # the root alone: every draft rejected
            rollbacks.append(time.perf_counter() - began)
    return statistics.median(forwards), statistics.median(rollbacks) if rollbacks else float("nan")


def recurrence_strategies(model, rows: int, rounds: int) -> dict:
    """The two ways to roll a recurrent state back, their recurrence alone (every Gated DeltaNet layer of the
    model, the compiled kernel): keeping each verified row's state during the forward (what the cache does), or
    keeping only the last and recomputing the accepted rows' recurrence after a rejection (here half of them)
    from the state before the forward. Median seconds per verify step of `rows` rows -> {keep, recompute}."""
    from specdecode.models.kernels.w4a8_linear import load_kernel

    fused = load_kernel().delta_rule
    mixers = [layer.mixer for layer in model.layers if layer.kind == "linear_attention"]
    heads, key_dim, value_dim = mixers[0].value_heads, mixers[0].key_dim, mixers[0].value_dim
    generator = torch.Generator().manual_seed(3)
    q, k = (torch.nn.functional.normalize(torch.randn(1, rows, heads, key_dim, generator=generator), dim=-1)
            for _ in range(2))
    v = torch.randn(1, rows, heads, value_dim, generator=generator)
    decay, beta = torch.rand(1, rows, heads, generator=generator), torch.rand(1, rows, heads, generator=generator)
    states = [torch.randn(1, heads, key_dim, value_dim, generator=generator) for _ in mixers]
    accepted = max(1, rows // 2)
    times = {"keep": [], "recompute": []}
    for _ in range(rounds):
        began = time.perf_counter()
        for state in states:
            fused(q, k, v, decay, beta, state, None, 0)
        times["keep"].append(time.perf_counter() - began)
        began = time.perf_counter()
        for state in states:
            fused(q, k, v, decay, beta, state, None, rows - 1)
            if accepted < rows:  # the rejection: the accepted rows again, from the state before the forward
                fused(*(x[:, :accepted] for x in (q, k, v, decay, beta)), state, None, accepted - 1)
        times["recompute"].append(time.perf_counter() - began)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="0.8b")
    parser.add_argument("--quant", default="w4a8")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--work", type=Path, default=Path("/tmp/specdecode-hybrid"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from specdecode.models.loader import load_model

    folder = write_random(args.work / args.shape, SHAPES[args.shape])
    model = load_model(folder, dtype="bfloat16", quant=args.quant).model
    prompt = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(1))
    rows_tried = (1, 2, 4, 8, 16)
    results = {"shape": args.shape, "quant": args.quant, "threads": torch.get_num_threads(), "verify": {}}
    with torch.inference_mode():
        for rows in rows_tried:
            kept, rollback = timed(model, prompt, rows, rows + 1, args.rounds)  # a speculative request's cache
            plain, _ = timed(model, prompt, rows, 1, args.rounds)  # plain decoding's: the last state only
            results["verify"][rows] = {"seconds": kept, "plain_cache_seconds": plain, "rollback_seconds": rollback,
                                       "recurrence": recurrence_strategies(model, rows, args.rounds)}
    one = results["verify"][1]["plain_cache_seconds"]
    lines = [f"# Qwen 3.5 {args.shape} shape, random weights, {args.quant}, {results['threads']} threads", "",
             f"plain decoding: {1 / one:.1f} tokens/s ({one * 1000:.1f} ms a token)", "",
             ("| rows | verify forward ms | x one row | rows' states kept vs not | rollback (keep) ms | % of the step "
             "| recurrence, every row's state kept ms | recurrence, last kept + half recomputed ms |"),
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rows, row in results["verify"].items():
        plain = row["plain_cache_seconds"]
        kept = f"{(row['seconds'] / plain - 1) * 100:+.1f}%"
        lines.append(f"| {rows} | {row['seconds'] * 1000:.1f} | {row['seconds'] / one:.2f} | {kept} | "
                     f"{row['rollback_seconds'] * 1000:.3f} | {row['rollback_seconds'] / row['seconds'] * 100:.2f} | "
                     f"{row['recurrence']['keep'] * 1000:.2f} | {row['recurrence']['recompute'] * 1000:.2f} |")
    write_report(args.out, f"hybrid-{args.shape}-{args.quant}", results, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
