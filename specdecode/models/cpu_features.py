"""The CPU's feature flags, in Linux's names, for the choices that depend on them: the w4a8 kernel's variant
(kernels/w4a8_linear.py) and the fewest rows of a packed bf16 product (decoder/packed_linear.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# macOS names its CPU features in sysctl's hw.optional tree: those the variants need, by their Linux names.
_DARWIN_FLAGS = {"hw.optional.avx2_0": "avx2", "hw.optional.fma": "fma", "hw.optional.avx512f": "avx512f",
                 "hw.optional.avx512bw": "avx512bw", "hw.optional.avx512vnni": "avx512_vnni",
                 "hw.optional.avxvnni": "avx_vnni", "hw.optional.arm.FEAT_DotProd": "asimddp"}


def cpu_flags() -> set[str]:
    """The CPU's feature flags in Linux's names: /proc/cpuinfo's "flags" (x86) or "Features" (ARM) line on Linux,
    sysctl's hw.optional tree on macOS; empty where neither answers."""
    if sys.platform == "darwin":
        return _darwin_flags(_read_command(["sysctl", "hw.optional"]))
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _darwin_flags(listing: str) -> set[str]:
    """`sysctl hw.optional`'s lines ("hw.optional.avx2_0: 1") -> the flags set to 1, in Linux's names."""
    flags = set()
    for line in listing.splitlines():
        name, _, value = line.partition(":")
        if value.strip() == "1" and name.strip() in _DARWIN_FLAGS:
            flags.add(_DARWIN_FLAGS[name.strip()])
    return flags


def _read_command(command: list[str]) -> str:
    """What a command prints, or "" where it cannot run."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
