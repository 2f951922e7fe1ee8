"""Sum the speed guard's and the drafters' step counts per method from a `specdecode bench` results.json.

    python docs/benchmarks/guard_stats.py docs/benchmarks/2026-12-01-guard/results.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a results.json written by specdecode bench")
    results = json.load(open(parser.parse_args().results))
    print("| method | target forwards | shrinks | pauses | steps without drafts, by reason |")
    print("|---|---|---|---|---|")
    for method, repeats in results["questions"].items():
        reasons, shrinks, pauses, forwards = Counter(), 0, 0, 0
        for question in (q for repeat in repeats for q in repeat if q["stats"]):
            stats = question["stats"]
            reasons.update(stats.get("steps_without_draft", {}))
            shrinks += stats.get("guard_shrinks", 0)
            pauses += stats.get("guard_pauses", 0)
            forwards += stats["target_forwards"]
        listed = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items())) or "-"
        print(f"| {method} | {forwards} | {shrinks} | {pauses} | {listed} |")


if __name__ == "__main__":
    main()
