"""Plain decoding of a Qwen 3.5 shape against llama.cpp on the same Q4_K_M GGUF file, in one run.

    python docs/benchmarks/hybrid_vs_llamacpp.py --llama-bin DIR [--shape 0.8b] [--rounds 3] --out DIR

DIR holds llama.cpp's `llama-bench` and `llama-quantize`, built from the sources llama-cpp-python 0.3.36 bundles
(a llama.cpp with the qwen35 architecture: `cmake -S vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release
-DLLAMA_CURL=OFF && cmake --build build --target llama-bench llama-quantize -j 2`).

No Qwen 3.5 weights can be had offline, so the shape's random bf16 folder (hybrid_costs.py writes it) is
written as a float16 GGUF in llama.cpp's qwen35 layout (tests/gguf_files.py, as its converter writes one) and
quantized by llama.cpp's own `llama-quantize ... Q4_K_M`. Both engines then decode from that one file with
the same number of threads, in turns (llama.cpp, ours, llama.cpp, ...), so that drift in the machine's speed
falls on both:

- llama.cpp: `llama-bench -p 0 -n N`, its generation tokens/s (N tokens from an empty context), and
  `llama-bench -p P -n 0`, its prompt tokens/s;
- ours: the file loaded with `--quant auto` (w4a8 where the CPU has it, the Q4_K codes kept), plain decoding of
  N tokens after a one-token prompt through the Engine (tokens after the first over the time after prefill),
  and the Engine's prefill of a P-token prompt (no prefix cache).

Then greedy speculative decoding against plain decoding on the same engine, the target as its own draft model
(random weights give lookup drafters nothing to draft): identical or not.

Random weights decode the same amount of work per token as real ones; only acceptance would differ, and no
speculation runs here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch
from bench_files import write_report
from hybrid_costs import SHAPES, write_random
from llamacpp_runs import alternate_rounds, speed_table

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def quantized_file(folder: Path, work: Path, bin_dir: Path) -> Path:
    """The folder as a float16 qwen35 GGUF, then llama-quantize's Q4_K_M of it (each made once)."""
    from gguf_files import F16, write_qwen35_gguf

    f16, q4 = work / "model-f16.gguf", work / "model-Q4_K_M.gguf"
    if not q4.is_file():
        if not f16.is_file():
            write_qwen35_gguf(f16, folder, mtp=False, matrices=F16)
        subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(q4), "Q4_K_M", str(torch.get_num_threads())],
                       check=True, stdout=subprocess.DEVNULL)
    return q4


def speculation_identical(engine, tokens: int) -> dict:
    """Greedy output of speculative decoding against plain decoding on this target: identical or not, and drafts
    accepted of drafted. Random weights never repeat themselves, so lookup drafters find nothing to draft; the
    target drafting for itself as the draft model (chains of 3 and 6) makes every verify forward hold drafts, each
    of which must be accepted (its rows bitwise the one-row forwards that drafted them)."""
    from specdecode import SamplingParams, SpecConfig

    prompt = [300, 301, 302, 303] * 8
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    plain = engine.complete(prompt, sampling, SpecConfig("none")).token_ids
    results = {}
    for method, k in (("draft", 3), ("draft", 6)):
        result = engine.complete(prompt, sampling, SpecConfig(method, num_draft_tokens=k, guard=False,
                                                              adaptive=False))
        method = f"{method} k={k}"
        results[method] = {"identical": result.token_ids == plain, "drafted": result.stats.drafted_tokens,
                           "accepted": result.stats.accepted_tokens}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-bench and llama-quantize")
    parser.add_argument("--shape", choices=list(SHAPES), default="0.8b")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/specdecode-hybrid"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from specdecode import Engine, SamplingParams, load_model

    folder = write_random(args.work / args.shape, SHAPES[args.shape])
    model_file = quantized_file(folder, args.work / args.shape, args.llama_bin)
    threads = torch.get_num_threads()
    loaded = load_model(model_file, dtype="auto", quant="auto")
    engine = Engine(loaded, loaded)  # the target as its own draft model (speculation_identical)
    engine.complete([300], SamplingParams(max_tokens=8, ignore_eos=True))  # warm up
    runs = alternate_rounds(engine, args.llama_bin, model_file, args.rounds, args.tokens, args.prompt)
    identity = speculation_identical(engine, args.tokens)
    result = {"shape": args.shape, "file": model_file.name, "bytes": model_file.stat().st_size, "threads": threads,
              "our_quant": loaded.quant, "tokens": args.tokens, "prompt": args.prompt, "runs": runs,
              "speculation": identity}
    lines = [(f"# Qwen 3.5 {args.shape} shape, random weights, {model_file.name} "
             f"({model_file.stat().st_size / 2**20:.0f} MiB), {threads} threads"), "",
             *speed_table(runs, args.tokens, args.prompt)]
    lines += ["", f"ours loaded as {loaded.quant}; greedy speculation against plain decoding, {args.tokens} tokens: "
              + "; ".join(f"{m} {'identical' if r['identical'] else 'DIFFERS'} ({r['accepted']}/{r['drafted']} "
                          "drafts accepted)" for m, r in identity.items())]
    write_report(args.out, f"vs-llamacpp-{args.shape}", result, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
