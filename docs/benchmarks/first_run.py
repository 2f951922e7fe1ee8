"""README command 1 as a new user meets it: run twice in a fresh cache, and report both printed speedups.

The first run assembles the default models into an empty SPECDECODE_CACHE (a temporary folder), builds what it
builds and decodes; the second finds everything cached. Each is a fresh `specdecode generate ... --compare-plain`
process, so each pays whatever a process pays first (#62: a first run printed 0.52x where warm reruns printed
1.14x). Both ratios, acceptance and the stats line are printed, and written as JSON to --out when given.

    python docs/benchmarks/first_run.py [--runs 2] [--out first_run.json]

Run it on a quiet machine: the ratio compares two passes of the same process, but a second heavy job skews both.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
SPEEDUP = re.compile(r"speculative speedup ([0-9.]+)x; identical output: (\w+)")
STATS = re.compile(r"^\[\d+ prompt tokens.*\]$", re.MULTILINE)


def readme_command() -> list[str]:
    """The `specdecode generate ...` part of README command 1, as argv."""
    import shlex

    for line in README.read_text().splitlines():
        if line.startswith("pip install") and "specdecode generate" in line:
            return shlex.split(line[line.index("specdecode generate"):])
    sys.exit("README.md has no command 1 with `specdecode generate`")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="runs in the same fresh cache (default 2)")
    parser.add_argument("--out", type=Path, help="write the runs as JSON here")
    args = parser.parse_args()
    command = readme_command()
    runs = []
    with tempfile.TemporaryDirectory(prefix="specdecode-first-run-") as cache:
        environment = os.environ | {"SPECDECODE_CACHE": cache}
        for index in range(args.runs):
            began = time.perf_counter()
            done = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - began
            found = SPEEDUP.search(done.stderr)
            stats = STATS.search(done.stderr)
            run = {"run": index + 1, "exit": done.returncode, "wall_seconds": round(wall, 1),
                   "speedup": float(found.group(1)) if found else None,
                   "identical": found.group(2) if found else None, "stats": stats.group(0) if stats else None}
            runs.append(run)
            print(json.dumps(run), flush=True)
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                break
    first, *later = [run["speedup"] for run in runs]
    if later and first and all(later):
        print(f"first run {first:.2f}x; later runs {', '.join(f'{s:.2f}x' for s in later)}; first / second "
              f"{first / later[0]:.2f}")
    if args.out:
        args.out.write_text(json.dumps({"command": command, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
