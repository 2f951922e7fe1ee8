"""This process's resident memory, for the per-phase memory report of `generate --json` (see README)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the engine imports much of the package
    from specdecode.engine.engine import Engine
    from specdecode.engine.stats import GenerationStats


def peak_rss_bytes() -> int:
    """The most resident memory this process has held so far (Linux reports it in KiB, macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def rss_bytes() -> int | None:
    """Resident memory now, from /proc/self/statm; None where there is no /proc (then only the peak is known)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * resource.getpagesize()


def available_bytes() -> int | None:
    """Memory the kernel says new allocations can have without swapping (/proc/meminfo's MemAvailable); None
    where there is no /proc."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        return None
    return None


# The share of the memory available once the models are loaded that active requests' KV caches may hold: the rest
# is left to the prefix cache, the drafters' own caches and everything else on the machine.
KV_SHARE = 0.6


def default_kv_budget(prefix_cache_bytes: int) -> int | None:
    """The KV memory a server gives its active requests unless told (--kv-memory): KV_SHARE of what is available
    now, less the prefix cache's budget; None where the available memory cannot be read."""
    available = available_bytes()
    if available is None:
        return None
    return max(1, int(available * KV_SHARE) - prefix_cache_bytes)


def memory_report(engine: Engine, stats: GenerationStats, before_load: int | None, peaks: dict[str, int]) -> dict:
    """What one request's run holds against what it needs: the weights (target, draft model, drafter heads), its
    caches (the target's KV cache and the drafter's), resident memory before loading (the interpreter and
    libraries) and the peak after each phase (`peaks`, phase -> peak_rss_bytes() at its end).
    `peak_over_needed` is the peak above the pre-load memory over weights plus caches."""
    weights = {"target": engine.target.weights_bytes, "draft": engine.draft.weights_bytes if engine.draft else 0,
               "drafter_heads": engine.drafter_weights_bytes()}
    caches = stats.kv_cache_bytes + stats.drafter_request_bytes
    needed = sum(weights.values()) + caches
    peak = max(peaks.values())
    return {"weights_bytes": weights, "cache_bytes": caches, "needed_bytes": needed,
            "rss_before_load_bytes": before_load, "peak_rss_bytes": peaks,
            "peak_over_needed": round((peak - (before_load or 0)) / needed, 3) if needed else None}
