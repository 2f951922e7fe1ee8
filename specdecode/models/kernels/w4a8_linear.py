"""int4 weights x int8 activations on AVX-512 VNNI, AVX2 or ARM NEON: a CPU linear layer whose cost grows slowly with
the number of rows, so verifying several drafted tokens costs little more than decoding one (on AVX-512, 4 tokens
1.14x one, 8 tokens 1.72x: docs/benchmarks/verify_rows.py).

PyTorch's int4 CPU kernel dequantizes every weight to float again for every row, so a forward of 8 tokens costs 3x
one of a single token (docs/benchmarks/README.md), which is what makes speculation barely pay on an int4 target.
Here activations are quantized to int8 per group of 32 inputs (as llama.cpp quantizes its activations), integer dot
products (vpdpbusd, vpmaddubsw on AVX2, sdot on ARM) consume the 4-bit codes directly, and a block of codes is
unpacked once for several rows.

Weights take 4.625 bits each: 4-bit codes, and per group of 32 an 8-bit scale code and an 8-bit offset code, each
times a bfloat16 multiplier per row and 256 inputs (llama.cpp's Q4_K has the same structure with 6-bit codes;
float16 scales and offsets per group would cost 5 bits, and at one token a step reads every byte).

w3a8 is the same kernel over 3-bit codes (3.625 bits a weight, 0.78 of the bytes), for draft models, whose precision
never changes the output: each group's range is searched for the least squared error (searched_groups), since
min-max 3-bit codes lose a draft 4 points of acceptance and searched ones 1.4 (docs/benchmarks/README.md).

This is a different model from `--quant int4`: activations are rounded too. It is the same model for every batch of
rows, though: each row is quantized on its own and summed in the same order whatever the number of rows, so a
token's output does not depend on how many tokens share the forward (tested bit for bit).

The kernel (w4a8_core.cpp, and w4a8_layer.cpp's fused decoder layer) is written once on w4a8_simd.h's vectors and
compiled per instruction set: AVX-512 VNNI, AVX2 with AVX-VNNI, AVX2 and FMA, or ARM NEON with the dot product, the
best this CPU has (or the one SPECDECODE_W4A8_ISA names). Each variant is its own extension, compiled at first use
by torch.utils.cpp_extension (g++ and ninja) into torch's extensions folder, about 35 s once per machine and
variant (a build lock an interrupted compile left behind is removed once it is older than any compile). The
weight layout is the same for all, so one cached quantized model serves every CPU, and the matmul
gives the same floats on all (integer sums are exact, and the float scaling is the same per lane).
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.cpu_features import cpu_flags
from specdecode.models.kernels.quantized_linear import rows_in_multiples, searched_groups

W4A8_GROUP = 32  # inputs per group, for both the weights' scales and the activations' int8 scales
TILE_ROWS = 16  # output rows per tile: one 512-bit register of int32 sums, or two 256-bit ones
_BLOCK_GROUPS = 8  # groups per bfloat16 multiplier of the 8-bit scale and offset codes (256 inputs, as Q4_K)
# The extension's translation units: the torch-free core, and extension.cpp, which includes the rest (torch's
# headers parsed once, not once a file).
EXTENSION_SOURCES = ("w4a8_core.cpp", "extension.cpp")
STALE_LOCK_SECONDS = 600  # a build lock older than this was left by an interrupted compile (one takes ~35 s)
ISA_SETTING = "SPECDECODE_W4A8_ISA"  # environment variable forcing a variant, e.g. to test AVX2 on AVX-512
# The kernel's variants, best first: name -> (the CPU flags it needs, in Linux's /proc/cpuinfo names, and the
# g++ flags it is compiled with). -march=native is not used, so a variant's build does not depend on which CPU
# compiled it. NEON needs the dot product (asimddp: ARMv8.2-A on, e.g. Apple M1, Graviton 2, Raspberry Pi 5).
VARIANTS = {
    "avx512": (("avx512f", "avx512bw", "avx512_vnni"), ("-mavx512f", "-mavx512bw", "-mavx512vnni")),
    "avx_vnni": (("avx2", "fma", "avx_vnni"), ("-mavx2", "-mfma", "-mavxvnni")),
    "avx2": (("avx2", "fma"), ("-mavx2", "-mfma")),
    "neon": (("asimddp",), ("-march=armv8.2-a+dotprod",)),
}


def w4a8_fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE_ROWS == 0 and in_features % W4A8_GROUP == 0


_kernel = None  # the chosen variant's extension, once loaded: every forward needs it, so it is found in one lookup
_variants: dict = {}  # name -> extension, for every variant loaded in this process


def load_kernel(quiet: bool = True):
    """The compiled extension for this CPU (kernel_isa()), built on first use; one clear error where this CPU
    or machine cannot."""
    reason = w4a8_unavailable(quiet)
    if reason is not None:
        raise SpecDecodeError(f"--quant w4a8: {reason}; use --quant int4")
    return _kernel


def w4a8_unavailable(quiet: bool = True) -> str | None:
    """Why w4a8 cannot run here (the CPU or the compiler), or None once the kernel is loaded (compiled if
    needed). A SPECDECODE_W4A8_ISA this CPU cannot run is not a reason to fall back but a SpecDecodeError."""
    global _kernel
    if _kernel is not None:
        return None
    isa = kernel_isa()
    if isa is None:
        minimum = "neon" if platform.machine().lower() in ("aarch64", "arm64") else "avx2"
        missing = [flag for flag in VARIANTS[minimum][0] if flag not in cpu_flags()]
        alternative = "" if minimum == "neon" else f" (or {', '.join(VARIANTS['avx512'][0])})"
        return (f"it needs a CPU with {', '.join(VARIANTS[minimum][0])}{alternative}; this one lacks "
                f"{', '.join(missing)}")
    tools = missing_build_tools()
    if tools:
        return f"compiling its kernel needs {tools}"
    try:
        _kernel = load_variant(isa, quiet)
    except (RuntimeError, OSError, ImportError) as error:
        return f"could not compile its kernel: {str(error).splitlines()[0]}"
    return None


def missing_build_tools() -> str:
    """What compiling the kernel needs and this machine lacks, with where to get it ("" if nothing): the C++
    compiler torch.utils.cpp_extension calls ($CXX, else c++) and ninja."""
    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler}; Debian or Ubuntu: apt install g++, Fedora: dnf install gcc-c++, "
                       f"macOS: xcode-select --install)")
    if shutil.which("ninja") is None:
        missing.append("ninja (pip install ninja)")
    return " and ".join(missing)


def kernel_isa() -> str | None:
    """The variant for this CPU: the one SPECDECODE_W4A8_ISA names (a SpecDecodeError if it is not a variant or
    this CPU lacks a flag it needs), else the first of VARIANTS whose flags this CPU has; None if none."""
    flags = cpu_flags()
    forced = os.environ.get(ISA_SETTING, "")
    if not forced:
        return next((name for name, (needed, _) in VARIANTS.items() if set(needed) <= flags), None)
    if forced not in VARIANTS:
        raise SpecDecodeError(f"{ISA_SETTING}={forced}: not a w4a8 kernel variant; use one of {', '.join(VARIANTS)}")
    missing = [flag for flag in VARIANTS[forced][0] if flag not in flags]
    if missing:
        raise SpecDecodeError(f"{ISA_SETTING}={forced}: this CPU lacks {', '.join(missing)}; unset it to use the "
                              f"best variant this CPU runs")
    return forced


def load_variant(isa: str, quiet: bool = True):
    """One variant's extension (a name of VARIANTS), compiled on first use; whether this CPU runs it is the
    caller's business (tests load every variant the CPU runs, to compare them)."""
    if isa not in _variants:
        from torch.utils.cpp_extension import load

        if not quiet:
            print(f"loading the w4a8 kernel for {isa} (compiled once per machine, about 35 s)", file=sys.stderr,
                  flush=True)
        clear_stale_build_lock(f"specdecode_w4a8_{isa}")
        sources = [str(Path(__file__).with_name(name)) for name in EXTENSION_SOURCES]
        # Hidden symbols: two variants loaded in one process must not call into each other's functions.
        cflags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fvisibility=hidden", *VARIANTS[isa][1]]
        _variants[isa] = load(name=f"specdecode_w4a8_{isa}", sources=sources, extra_cflags=cflags,
                              extra_ldflags=["-fopenmp"], verbose=False)
    return _variants[isa]


def clear_stale_build_lock(name: str) -> bool:
    """Remove extension `name`'s build lock when it is older than any compile: torch.utils.cpp_extension waits
    for the lock to go, and a compile interrupted (Ctrl-C, a killed server) leaves it behind, so every later
    start would wait forever. -> whether one was removed."""
    # The folder load() builds in (torch's own helper: the root depends on the Python and accelerator build).
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_SECONDS:
        return False  # another process is compiling it now
    lock.unlink(missing_ok=True)
    print(f"removed {lock}, left {age / 60:.0f} minutes ago by an interrupted compile of the w4a8 kernel",
          file=sys.stderr)
    return True


def pack_tiles(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
               bits: int = 4) -> tuple[torch.Tensor, ...]:
    """codes [n, K] in [0, 2^bits - 1], scales and offsets [n, K/32] (w = code * scale + offset), n a multiple of
    16 -> the kernel's layout (see w4a8_core.cpp): codes [n/16, K/32, bits * 64] uint8, group_scales
    [n/16, K/32, 32] uint8 and block_scales [n/16, ceil(K/256), 32] bfloat16."""
    rows, in_features = codes.shape
    tiles, groups = rows // TILE_ROWS, in_features // W4A8_GROUP
    top = 2**bits - 1
    # A negative scale flips its group's codes, q * s + o = (top - q) * (-s) + (o + top s), so scale codes are
    # unsigned and keep all 8 bits.
    flipped = scales < 0  # [n, G]
    codes = torch.where(flipped.repeat_interleave(W4A8_GROUP, dim=1), top - codes, codes)
    offsets = torch.where(flipped, offsets + top * scales, offsets)
    scale_codes, scale_units = _codes_per_block(scales.abs(), 255)  # [n, G] in [0, 255], [n, B]
    offset_codes, offset_units = _codes_per_block(offsets, 127)  # [n, G] in [-127, 127], [n, B]

    quads = codes.to(torch.uint8).view(tiles, TILE_ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [T, G, 8, 16, 4]

    def per_tile(values: torch.Tensor) -> torch.Tensor:  # [n, X] -> [T, X, 16]
        return values.reshape(tiles, TILE_ROWS, -1).permute(0, 2, 1)

    group_scales = torch.cat([per_tile(scale_codes.to(torch.uint8)),
                              per_tile(offset_codes.to(torch.int8).view(torch.uint8))], dim=-1)  # [T, G, 32]
    block_scales = torch.cat([per_tile(scale_units), per_tile(offset_units)], dim=-1)  # [T, B, 32]
    return _packed_codes(quads, bits).contiguous(), group_scales.contiguous(), block_scales.contiguous()


def _packed_codes(quads: torch.Tensor, bits: int) -> torch.Tensor:
    """quads [T, G, 8, 16, 4] uint8 (a tile's group, its quad j of inputs 4j..4j+3, row, input in the quad) ->
    [T, G, bits * 64] uint8 in w4a8_core.cpp's layout."""
    tiles, groups = quads.shape[:2]
    if bits == 4:  # quads 0-3 in the low nibbles of runs 0-3, quads 4-7 in the high ones
        return (quads[:, :, :4] | (quads[:, :, 4:] << 4)).reshape(tiles, groups, 256)
    # Quads 0-5 in bits 0-2 and 3-5 of three vectors; quads 6 and 7 in their bits 6-7 (low two bits in the first
    # and second, third bits in the third).
    q = quads.unbind(2)  # 8 x [T, G, 16, 4]
    vectors = (q[0] | q[1] << 3 | (q[6] & 3) << 6, q[2] | q[3] << 3 | (q[7] & 3) << 6,
               q[4] | q[5] << 3 | (q[6] >> 2) << 6 | (q[7] >> 2) << 7)
    return torch.cat([v.reshape(tiles, groups, 64) for v in vectors], dim=-1)


def _codes_per_block(values: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """values [n, G] -> integer codes [n, G] in [-top, top] and bfloat16 units [n, ceil(G/8)], one per block of
    8 groups, with values ~= code * unit."""
    rows, groups = values.shape
    blocks = -(-groups // _BLOCK_GROUPS)
    padded = F.pad(values.float(), (0, blocks * _BLOCK_GROUPS - groups)).view(rows, blocks, _BLOCK_GROUPS)
    # Raised before rounding to bfloat16 (which moves a value by at most 2^-8 of it), so no code exceeds top.
    units = (padded.abs().amax(-1) / top * (1 + 2**-7)).to(torch.bfloat16)  # [n, B]
    unit = units.float().repeat_interleave(_BLOCK_GROUPS, dim=1)[:, :groups]  # [n, G]
    codes = torch.where(unit > 0, torch.round(values.float() / unit), 0).clamp(-top, top)  # [n, G]
    return codes.to(torch.int32), units


class W4A8Linear(nn.Module):
    """w = code * scale + offset per group of 32 inputs, codes in [0, 15] (w3a8: [0, 7]), scales and offsets in 8
    bits times a multiplier per 256 inputs; activations int8 per group of 32."""

    def __init__(self, codes: torch.Tensor, group_scales: torch.Tensor, block_scales: torch.Tensor,
                 bias: torch.Tensor | None):
        """codes [N/16, K/32, 256] uint8 (3-bit codes: 192), group_scales [N/16, K/32, 32] uint8, block_scales
        [N/16, ceil(K/256), 32] bfloat16 (w4a8_core.cpp's layout)."""
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("group_scales", group_scales)
        self.register_buffer("block_scales", block_scales)
        self.register_buffer("bias", bias.detach() if bias is not None else None)  # saved with the layer
        self.out_features = codes.shape[0] * TILE_ROWS
        self.in_features = codes.shape[1] * W4A8_GROUP
        self.bits = codes.shape[2] // 64  # 4, or 3 for w3a8

    @classmethod
    def from_groups(cls, blocks: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    bias: torch.Tensor | None) -> W4A8Linear:
        """Blocks of rows of (codes [n, K] in [0, 15], scales [n, K/32], zeros [n, K/32]) in the int4 layers'
        convention w = (code - 8) * scale + zero, the one GGUF Q4_K groups and min-max quantization give."""
        parts = []
        for codes, scales, zeros in rows_in_multiples(blocks, TILE_ROWS):
            if not w4a8_fits(*codes.shape):
                raise SpecDecodeError(f"w4a8 needs output sizes divisible by {TILE_ROWS} and input sizes by "
                                      f"{W4A8_GROUP}; a layer has {codes.shape[0]} x {codes.shape[1]}")
            parts.append(pack_tiles(codes, scales.float(), zeros.float() - 8 * scales.float()))
        return cls(*(torch.cat(part) for part in zip(*parts)), bias)

    @classmethod
    def from_rows(cls, blocks: Iterable[torch.Tensor], bias: torch.Tensor | None, bits: int) -> W4A8Linear:
        """Blocks of a float weight's rows [n, K], each group of 32 at `bits` bits over its searched range."""
        parts = []
        for (rows,) in rows_in_multiples(((block,) for block in blocks), TILE_ROWS):
            if not w4a8_fits(*rows.shape):
                raise SpecDecodeError(f"w{bits}a8 needs output sizes divisible by {TILE_ROWS} and input sizes by "
                                      f"{W4A8_GROUP}; a layer has {rows.shape[0]} x {rows.shape[1]}")
            parts.append(pack_tiles(*searched_groups(rows, bits, W4A8_GROUP), bits=bits))
        return cls(*(torch.cat(part) for part in zip(*parts)), bias)

    def kernel_weight(self):
        """This layer's tensors as the compiled extension's Weight, for the fused layers and blocks that hold it."""
        return (_kernel or load_kernel()).weight(self.codes, self.group_scales, self.block_scales, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()  # [R, K]: the kernel reads float32 rows
        kernel = _kernel or load_kernel()
        out = kernel.w4a8_mm(flat, self.codes, self.group_scales, self.block_scales).to(x.dtype)  # [R, N]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)
