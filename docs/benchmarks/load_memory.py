"""Peak memory and time of loading a quantized model: the first build from the GGUF file, then the cached load.

Run from the repository root: python docs/benchmarks/load_memory.py [--model NAME] [--quant int4]

Each load runs in a fresh process with an empty quantized cache (a temporary SPECDECODE_CACHE), so the first
load builds and the second reads what the first saved. A thread samples /proc/self/status every 20 ms: anonymous
memory (what the load itself allocates) and file-backed memory (pages of the memory-mapped GGUF or cache file,
which the kernel can drop and reread) are reported apart, next to the kernel's own peak RSS (VmHWM).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from specdecode.models.formats.default_models import DEFAULT_TARGET
from specdecode.models.loader import resolve_source

CHILD = """
import json, sys, threading, time
from specdecode.models.loader import load_model

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) / 2**20 for key in ("RssAnon", "RssFile", "VmHWM")}  # GiB

peaks = {"RssAnon": 0.0, "RssFile": 0.0}
done = threading.Event()

def sample():
    while not done.wait(0.02):
        for key, value in status().items():
            if key in peaks:
                peaks[key] = max(peaks[key], value)

threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
model = load_model(sys.argv[1], quant=sys.argv[2], quiet=True).model
seconds = time.perf_counter() - start
done.set()
size = sum(t.nbytes for t in [*model.parameters(), *model.buffers()]) / 2**30
print(json.dumps({"seconds": seconds, "model_gib": size, "peak_anon_gib": peaks["RssAnon"],
                  "peak_file_gib": peaks["RssFile"], "vmhwm_gib": status()["VmHWM"]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--quant", default="int4", choices=("int8", "int4"))
    args = parser.parse_args()
    print("| load | seconds | model GiB | peak anonymous GiB | peak file-backed GiB | peak RSS (VmHWM) GiB |")
    print("|---|---|---|---|---|---|")
    source = resolve_source(args.model, quiet=False)  # a default model's GGUF file stays in the user's cache
    with tempfile.TemporaryDirectory() as cache:
        environment = os.environ | {"SPECDECODE_CACHE": cache}
        for label in ("build from GGUF", "cached"):
            command = [sys.executable, "-c", CHILD, str(source), args.quant]
            out = subprocess.run(command, env=environment, capture_output=True, text=True, check=True).stdout
            m = json.loads(out.strip().splitlines()[-1])
            print(f"| {label} | {m['seconds']:.1f} | {m['model_gib']:.2f} | {m['peak_anon_gib']:.2f} | "
                  f"{m['peak_file_gib']:.2f} | {m['vmhwm_gib']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
