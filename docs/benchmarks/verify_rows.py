"""What verifying k drafted tokens costs: the default target's whole forward over M new tokens against one, in
w4a8, after a cached context, M = 1 to 16; with --against COMMIT, the w4a8 kernel of that commit too, timed in
the same process, each forward of one build followed by the same forward of the other.

Run from the repository root: python docs/benchmarks/verify_rows.py [--against 2088d01] [--context 200]

Every round times each M once, in turn, so that a slow spell of a shared machine falls on every M (and both
builds) alike; a cell is the median over rounds. M = 1 is a decode step; a chain of k drafts is verified by a
forward of k + 1 tokens. With --against the two builds' logits are also compared (the kernel's sums are exact
integers scaled in a fixed order, so a change of schedule alone leaves them bitwise equal).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import specdecode.models.kernels.w4a8_linear as w4a8_linear
from specdecode import load_model
from specdecode.models.formats.default_models import DEFAULT_TARGET

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
QUANT = "specdecode/models/kernels"


def kernel_at(commit: str, isa: str):
    """The w4a8 extension built from `commit`'s kernel sources, for the variant this process uses."""
    from torch.utils.cpp_extension import load

    folder = Path(tempfile.mkdtemp(prefix=f"w4a8-{commit}-"))
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{commit}:{QUANT}"], check=True, capture_output=True,
                             text=True).stdout.split()
    names = [name for name in listing if name.endswith((".cpp", ".h"))]  # that commit's own set of C++ files
    for name in names:
        text = subprocess.run(["git", "show", f"{commit}:{QUANT}/{name}"], check=True, capture_output=True,
                              text=True).stdout
        (folder / name).write_text(text)
    flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden", *w4a8_linear.VARIANTS[isa][1]]
    # Since extension.cpp the torch-using files are included by it, not compiled on their own.
    units = w4a8_linear.EXTENSION_SOURCES if "extension.cpp" in names else [n for n in names if n.endswith(".cpp")]
    return load(name=f"specdecode_w4a8_{isa}_{commit}", extra_cflags=flags, extra_ldflags=["-fopenmp"],
                sources=[str(folder / name) for name in units])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--against", metavar="COMMIT", help="also time the w4a8 kernel of this git commit")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    builds = {"this tree": w4a8_linear.load_kernel()}
    if args.against:
        builds[args.against] = kernel_at(args.against, w4a8_linear.kernel_isa())
    # The fused layers bind the kernel they were built with; the output head calls the module's current one.
    models = {}
    for name, kernel in builds.items():
        w4a8_linear._kernel = kernel
        models[name] = load_model(args.model, quant="w4a8", quiet=True).model
    caches = {name: model.new_cache(args.context + max(ROWS)) for name, model in models.items()}
    samples = {(name, rows): [] for name in builds for rows in ROWS}
    logits = {}
    with torch.inference_mode():
        context = torch.arange(args.context).unsqueeze(0)  # [1, C]
        for name, model in models.items():
            w4a8_linear._kernel = builds[name]
            model(context % 1000, context, caches[name])
        for round_index in range(args.rounds + 1):
            for rows in ROWS:
                tokens = torch.full((1, rows), 7)  # [1, M]
                positions = torch.arange(args.context, args.context + rows).unsqueeze(0)  # [1, M]
                for name, model in models.items():
                    w4a8_linear._kernel = builds[name]
                    start = time.perf_counter()
                    logits[name, rows] = model(tokens, positions, caches[name]).logits  # [1, M, V]
                    elapsed = time.perf_counter() - start
                    caches[name].truncate(args.context)
                    if round_index:  # the first round warms every shape up
                        samples[name, rows].append(elapsed * 1000)
    print(f"{args.model}, w4a8 ({w4a8_linear.kernel_isa()}), context {args.context}, {torch.get_num_threads()} "
          f"threads, median of {args.rounds} rounds")
    print("| M | " + " | ".join(f"{name}: ms | x one token" for name in builds) + " |")
    print("|---|" + "---|---|" * len(builds))
    for rows in ROWS:
        cells = []
        for name in builds:
            ms, one = statistics.median(samples[name, rows]), statistics.median(samples[name, 1])
            cells.append(f"{ms:.1f} | {ms / one:.2f}")
        print(f"| {rows} | " + " | ".join(cells) + " |")
    if args.against:
        same = all(torch.equal(logits["this tree", rows], logits[args.against, rows]) for rows in ROWS)
        print(f"logits bitwise equal between the builds: {same}")


if __name__ == "__main__":
    main()
