"""Our Engine and llama.cpp's llama-bench on one GGUF file, in turns: what the *_vs_llamacpp.py scripts share."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import torch


def llama_cpp_speed(bin_dir: Path, model: Path, prompt: int, tokens: int, threads: int) -> float:
    """llama-bench's tokens/s reading `prompt` tokens (tokens=0) or generating `tokens` from an empty context
    (prompt=0), one repetition."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(prompt), "-n", str(tokens),
                          "-t", str(threads), "-r", "1", "-o", "json"], check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout)[0]["avg_ts"])


def our_speed(engine, prompt: int, tokens: int) -> float:
    """Our tokens/s reading a `prompt`-token prompt (tokens=1: its read alone is timed) or decoding `tokens`
    after a one-token prompt (the tokens after the first over the time after the prefill)."""
    from specdecode import SamplingParams, SpecConfig

    ids = torch.randint(300, engine.target.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
    request = engine.begin(ids.tolist(), SamplingParams(max_tokens=tokens, ignore_eos=True), SpecConfig("none"),
                           reuse_prefix=False)
    began = time.perf_counter()
    engine.prefill(request)
    if tokens == 1:
        seconds = time.perf_counter() - began
        engine.finish(request)
        return prompt / seconds
    began = time.perf_counter()
    while request.generated < tokens:
        engine.step(request)
    seconds = time.perf_counter() - began
    engine.finish(request)
    return (tokens - 1) / seconds


def alternate_rounds(engine, bin_dir: Path, model: Path, rounds: int, tokens: int, prompt: int) -> dict:
    """llama.cpp and ours in turns (llama.cpp, ours, llama.cpp, ...), so that drift in the machine's speed falls
    on both: -> phase -> {"llama_cpp": [tokens/s a round], "ours": [...]}, decode (`tokens` after a one-token
    prompt) and prefill (a `prompt`-token prompt)."""
    threads = torch.get_num_threads()
    phases = {"decode": (0, tokens), "prefill": (prompt, 0)}
    runs = {phase: {"llama_cpp": [], "ours": []} for phase in phases}
    for round_ in range(rounds):
        for phase, (prompt_, tokens_) in phases.items():
            runs[phase]["llama_cpp"].append(llama_cpp_speed(bin_dir, model, prompt_, tokens_, threads))
            runs[phase]["ours"].append(our_speed(engine, max(prompt_, 1), max(tokens_, 1)))
            print(f"round {round_ + 1} {phase}: llama.cpp {runs[phase]['llama_cpp'][-1]:.1f} tokens/s, ours "
                  f"{runs[phase]['ours'][-1]:.1f}", flush=True)
    return runs


def speed_table(runs: dict, tokens: int, prompt: int) -> list[str]:
    """alternate_rounds' runs as a markdown table of medians and per-round ratios."""
    lines = ["| phase | llama.cpp tokens/s (median) | ours tokens/s (median) | ours / llama.cpp | per round |",
             "|---|---:|---:|---:|---|"]
    for phase, run in runs.items():
        theirs, ours = statistics.median(run["llama_cpp"]), statistics.median(run["ours"])
        per_round = ", ".join(f"{o / t:.2f}" for t, o in zip(run["llama_cpp"], run["ours"]))
        label = f"decode {tokens}" if phase == "decode" else f"prefill {prompt}"
        lines.append(f"| {label} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f} | {per_round} |")
    return lines
