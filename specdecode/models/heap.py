"""How glibc's malloc hands memory back, set where the default costs us (other C libraries lack mallopt and keep
their own behaviour).

- Loading: glibc raises its mmap threshold (up to 32 MB) each time a mapped block is freed, after which blocks
  of rows of that size come from the heap, which keeps them once freed: 1.2 GiB more anonymous memory at the peak
  of the 1.5B's quantized build. A fixed threshold keeps every block of 4 MB or more mapped, so freeing it
  returns it to the system.
- A hybrid trunk's verify forward keeps each row's recurrent state (families/qwen3_5/cache.py; 1 MiB a Gated
  DeltaNet layer at Qwen 3.5 0.8B's shape, 144 MiB for 8 rows), and the next step frees most of them. With the
  heap's top trimmed back at 2x the threshold, every step faulted its pages in again: an 8-row verify took 44%
  longer than the same forward keeping no states (docs/benchmarks, 2026-12-04 hybrid). Up to 256 MB of freed heap
  is kept for reuse instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
_MMAP_FROM_BYTES = 4 << 20
_KEEP_FREED_BYTES = 256 << 20


def _mallopt(parameter: int, value: int) -> None:
    name = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    if mallopt is not None:
        mallopt(parameter, value)


def free_large_blocks_promptly() -> None:
    """Blocks of 4 MB or more are mapped, and unmapped when freed."""
    _mallopt(_M_MMAP_THRESHOLD, _MMAP_FROM_BYTES)


def keep_freed_heap() -> None:
    """The same mapping rule, and up to 256 MB of freed heap kept for the next step rather than returned."""
    free_large_blocks_promptly()
    _mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED_BYTES)
