"""Our default target against llama.cpp's own server on the same GGUF file: plain decoding and the best of each.

Run from the repository root (about 5 minutes on 2 cores):

    python docs/benchmarks/plain_vs_llamacpp.py --llama-server PATH [--prompts 8] [--max-tokens 128] [--quant w4a8]
        [--dtype auto] [--dataset PATH[:N] ...] [--float-methods "none;ngram,draft"]

PATH is a llama-server binary. llama-cpp-python ships llama.cpp's sources without the binary; to build the one
it bundles (commit 0c1e57098), from its unpacked sdist (`pip download llama-cpp-python==0.3.36 --no-binary
:all: --no-deps`):

    cmake -S vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
    cmake --build build --target llama-server llama-bench -j 2

Two llama-servers run for the whole benchmark, plain and with n-gram speculation (`--spec-type ngram-simple`),
both with 2 threads on the default Q4_K_M file. Every prompt is run by each llama.cpp setup and each of our
methods in turn, so that drift in the machine's speed hits all alike, with the same prompt token ids (each
dataset question's first turn in the chat template), greedy, at most --max-tokens tokens, ending at the end of
turn as a user's request does (text written past it repeats itself and would flatter n-gram drafting). Speed
is generation-phase tokens/s: tokens after the first over the time after prefill (llama.cpp's own
`timings.predicted_per_second`, so HTTP costs it nothing). `--float-methods` also runs those methods on the
target loaded in float (`--quant none --dtype bf16`, the same draft), each compared with that target's own
plain decoding. Each llama-server's peak resident memory (VmHWM) is printed at the end; ours is one process
holding several models, so its per-configuration memory comes from `specdecode generate --json` runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from cpu_decode import PROMPTS

from specdecode import Engine, SamplingParams, SpecConfig, load_model
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_MODELS, DEFAULT_TARGET, assemble

LLAMA_SETUPS = {"llama.cpp plain": [], "llama.cpp ngram-simple": ["--spec-type", "ngram-simple"]}
OUR_METHODS = ("none", "ngram", "draft", "ngram,draft", "auto")  # auto: what `generate` runs by default


def spec_for(method: str) -> SpecConfig:
    """A method of ours as SpecConfig ("auto": the engine runs what it finds for the loaded pair)."""
    return SpecConfig(method)


def start_server(binary: Path, gguf: Path, port: int, extra: list[str]) -> subprocess.Popen:
    command = [str(binary), "-m", str(gguf), "-t", "2", "-tb", "2", "-c", "4096", "-np", "1",
               "--port", str(port), *extra]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit(f"llama-server on port {port} did not start: {' '.join(command)}")


def llama_cpp_run(port: int, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], float, int]:
    """Greedy tokens, generation-phase seconds and tokens counted in them, from the server's own timings."""
    body = {"prompt": prompt_ids, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False,
            "return_tokens": True}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(request))
    timings = reply["timings"]
    return reply["tokens"], timings["predicted_ms"] / 1000, timings["predicted_n"] - 1


def peak_memory_gib(server: subprocess.Popen) -> float:
    """A running process's peak resident memory (Linux's VmHWM), in GiB."""
    for line in Path(f"/proc/{server.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise SystemExit(f"no VmHWM for process {server.pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, required=True, help="a llama-server binary")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quant", default="w4a8", help="our target's --quant (the draft is w4a8)")
    parser.add_argument("--dtype", default="auto", help="our target's --dtype")
    parser.add_argument("--dataset", action="append", default=[],
                        help="Spec-Bench jsonl, each first turn a prompt; PATH or PATH:N for N of its prompts "
                             "(default --prompts); repeat for several (default HumanEval)")
    parser.add_argument("--float-methods", default="",
                        help="also run these methods (';' between them, plain first) on the target in bf16")
    args = parser.parse_args()
    gguf = assemble(DEFAULT_MODELS[DEFAULT_TARGET], quiet=True)
    draft = load_model(DEFAULT_DRAFT, quiet=True, quant="w4a8")
    # label -> (engine, its methods, plain first)
    ours = {f"ours {args.quant}": (Engine(load_model(DEFAULT_TARGET, dtype=args.dtype, quiet=True, quant=args.quant),
                                          draft), OUR_METHODS)}
    if args.float_methods:
        ours["ours bf16"] = (Engine(load_model(DEFAULT_TARGET, dtype="bfloat16", quiet=True, quant="none"), draft),
                             tuple(args.float_methods.split(";")))
    engine = next(iter(ours.values()))[0]
    sampling = SamplingParams(max_tokens=args.max_tokens)
    prompts = []  # (dataset name, prompt token ids)
    for spec in args.dataset or [str(PROMPTS)]:
        path, _, count = spec.partition(":")
        lines = Path(path).read_text().splitlines()[: int(count or args.prompts)]
        prompts += [(Path(path).name, engine.encode(json.loads(line)["turns"][0])) for line in lines]
    runs = [*LLAMA_SETUPS, *(f"{label} `{method}`" for label, (_, methods) in ours.items() for method in methods)]
    totals = {}  # (dataset name or "all", run) -> [generation seconds, tokens counted, outputs identical to plain]
    with ExitStack() as stack:
        servers = {}
        for port, (name, extra) in enumerate(LLAMA_SETUPS.items(), start=8091):
            servers[name] = (start_server(args.llama_server, gguf, port, extra), port)
            stack.callback(servers[name][0].kill)
        for _, port in servers.values():  # warm-up
            llama_cpp_run(port, prompts[0][1], 8)
        for our_engine, _ in ours.values():
            our_engine.complete(prompts[0][1], SamplingParams(max_tokens=8), SpecConfig("ngram,draft"))

        def count(dataset: str, name: str, elapsed: float, counted: int, identical: bool) -> None:
            for key in ((dataset, name), ("all", name)):
                total = totals.setdefault(key, [0.0, 0, 0])
                total[0], total[1], total[2] = total[0] + elapsed, total[1] + counted, total[2] + identical

        for number, (dataset, ids) in enumerate(prompts, start=1):
            reference = None
            for name, (_, port) in servers.items():
                output, elapsed, counted = llama_cpp_run(port, ids, args.max_tokens)
                reference = reference or output
                count(dataset, name, elapsed, counted, output == reference)
            for label, (our_engine, methods) in ours.items():
                plain = None
                for method in methods:
                    result = our_engine.complete(ids, sampling, spec_for(method))
                    plain = plain or result.token_ids
                    # the first token comes from prefill
                    count(dataset, f"{label} `{method}`", result.stats.total_seconds - result.stats.prefill_seconds,
                          result.stats.new_tokens - 1, result.token_ids == plain)
            print(f"prompt {number}/{len(prompts)} done", flush=True)
        peaks = {name: peak_memory_gib(server) for name, (server, _) in servers.items()}
    print(f"at most {args.max_tokens} tokens (natural ends), greedy, generation phase, 2 threads; ours: target "
          f"--quant {args.quant} --dtype {args.dtype} (and bf16 where named), draft w4a8")
    for dataset in [*dict.fromkeys(name for name, _ in prompts), "all"]:
        prompt_count = sum(dataset in (name, "all") for name, _ in prompts)
        base = totals[dataset, "llama.cpp plain"][1] / totals[dataset, "llama.cpp plain"][0]
        print(f"\n{dataset}: {prompt_count} prompts, {totals[dataset, runs[2]][1] + prompt_count} tokens in our "
              "plain outputs\n| decoder | tok/s | x llama.cpp plain | identical to its own plain |\n|---|---|---|---|")
        for name in runs:
            elapsed, counted, identical = totals[dataset, name]
            print(f"| {name} | {counted / elapsed:.2f} | {counted / elapsed / base:.2f} | {identical}/{prompt_count} |")
    print("\nllama-server peak resident memory: " + ", ".join(f"{name} {gib:.2f} GiB" for name, gib in peaks.items()))


if __name__ == "__main__":
    main()
