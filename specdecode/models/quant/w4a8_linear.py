"""int4 weights x int8 activations on AVX-512 VNNI: a CPU linear layer whose cost stays nearly flat in the
number of rows, so verifying several drafted tokens costs little more than decoding one.

PyTorch's int4 CPU kernel dequantizes every weight to float again for every row, so a forward of 8 tokens
costs 3x one of a single token (docs/benchmarks/README.md), which is what makes speculation barely pay on an
int4 target. Here activations are quantized to int8 per group of 32 inputs (as llama.cpp quantizes its
activations), integer dot products (vpdpbusd) consume the 4-bit codes directly, and a block of codes is
unpacked once for up to 8 rows.

Weights take 4.625 bits each: 4-bit codes, and per group of 32 an 8-bit scale code and an 8-bit offset code,
each times a bfloat16 multiplier per row and 256 inputs (llama.cpp's Q4_K has the same structure with 6-bit
codes; float16 scales and offsets per group would cost 5 bits, and at one token a step reads every byte).

This is a different model from `--quant int4`: activations are rounded too. It is the same model for every
batch of rows, though: each row is quantized on its own and summed in the same order whatever the number of
rows, so a token's output does not depend on how many tokens share the forward (tested bit for bit).

The kernel (w4a8_kernel.cpp, and w4a8_layer.cpp's fused decoder layer) is compiled at first use by
torch.utils.cpp_extension (g++ and ninja) into torch's extensions folder, about 35 s once per machine.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.quant.quantized_linear import rows_in_multiples

W4A8_GROUP = 32  # inputs per group, for both the weights' scales and the activations' int8 scales
_TILE_ROWS = 16  # output rows per tile: one 512-bit register of int32 sums
_BLOCK_GROUPS = 8  # groups per bfloat16 multiplier of the 8-bit scale and offset codes (256 inputs, as Q4_K)
_NEEDED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")


def w4a8_fits(out_features: int, in_features: int) -> bool:
    return out_features % _TILE_ROWS == 0 and in_features % W4A8_GROUP == 0


_kernel = None  # the compiled extension, once loaded: every forward needs it, so it is found in one lookup


def load_kernel(quiet: bool = True):
    """The compiled extension, built on first use; one clear error where this CPU or machine cannot."""
    reason = w4a8_unavailable(quiet)
    if reason is not None:
        raise SpecDecodeError(f"--quant w4a8: {reason}; use --quant int4")
    return _kernel


def w4a8_unavailable(quiet: bool = True) -> str | None:
    """Why w4a8 cannot run here (the CPU or the compiler), or None once the kernel is loaded (compiled if
    needed)."""
    global _kernel
    if _kernel is not None:
        return None
    flags = _cpu_flags()
    missing = [flag for flag in _NEEDED_CPU_FLAGS if flag not in flags]
    if missing:
        return f"it needs a CPU with {', '.join(_NEEDED_CPU_FLAGS)}; this one lacks {', '.join(missing)}"
    from torch.utils.cpp_extension import load

    if not quiet:
        print("loading the w4a8 kernel (compiled once per machine, about 35 s)", file=sys.stderr, flush=True)
    try:
        sources = [str(Path(__file__).with_name(name)) for name in ("w4a8_kernel.cpp", "w4a8_layer.cpp")]
        _kernel = load(name="specdecode_w4a8", sources=sources, extra_ldflags=["-fopenmp"], verbose=False,
                       extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"])
    except (RuntimeError, OSError, ImportError) as error:
        return f"could not compile its kernel (it needs g++ and ninja): {str(error).splitlines()[0]}"
    return None


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def pack_tiles(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """codes [n, K] in [0, 15], scales and offsets [n, K/32] (w = code * scale + offset), n a multiple of 16
    -> the kernel's layout (see w4a8_kernel.cpp): codes [n/16, K/32, 256] uint8, group_scales [n/16, K/32, 32]
    uint8 and block_scales [n/16, ceil(K/256), 32] bfloat16."""
    rows, in_features = codes.shape
    tiles, groups = rows // _TILE_ROWS, in_features // W4A8_GROUP
    # A negative scale flips its group's codes, q * s + o = (15 - q) * (-s) + (o + 15 s), so scale codes are
    # unsigned and keep all 8 bits.
    flipped = scales < 0  # [n, G]
    codes = torch.where(flipped.repeat_interleave(W4A8_GROUP, dim=1), 15 - codes, codes)
    offsets = torch.where(flipped, offsets + 15 * scales, offsets)
    scale_codes, scale_units = _codes_per_block(scales.abs(), 255)  # [n, G] in [0, 255], [n, B]
    offset_codes, offset_units = _codes_per_block(offsets, 127)  # [n, G] in [-127, 127], [n, B]

    quads = codes.to(torch.uint8).view(tiles, _TILE_ROWS, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [T, G, 8, 16, 4]
    packed = quads[:, :, :4] | (quads[:, :, 4:] << 4)  # [T, G, 4, 16, 4]: inputs 16-31 in the high nibbles

    def per_tile(values: torch.Tensor) -> torch.Tensor:  # [n, X] -> [T, X, 16]
        return values.reshape(tiles, _TILE_ROWS, -1).permute(0, 2, 1)

    group_scales = torch.cat([per_tile(scale_codes.to(torch.uint8)),
                              per_tile(offset_codes.to(torch.int8).view(torch.uint8))], dim=-1)  # [T, G, 32]
    block_scales = torch.cat([per_tile(scale_units), per_tile(offset_units)], dim=-1)  # [T, B, 32]
    return packed.reshape(tiles, groups, 256).contiguous(), group_scales.contiguous(), block_scales.contiguous()


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
    """w = code * scale + offset per group of 32 inputs, codes in [0, 15], scales and offsets in 8 bits times a
    multiplier per 256 inputs; activations int8 per group of 32."""

    def __init__(self, codes: torch.Tensor, group_scales: torch.Tensor, block_scales: torch.Tensor,
                 bias: torch.Tensor | None):
        """codes [N/16, K/32, 256] uint8, group_scales [N/16, K/32, 32] uint8, block_scales [N/16, ceil(K/256), 32]
        bfloat16 (w4a8_kernel.cpp's layout)."""
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("group_scales", group_scales)
        self.register_buffer("block_scales", block_scales)
        self.register_buffer("bias", bias.detach() if bias is not None else None)  # saved with the layer
        self.out_features = codes.shape[0] * _TILE_ROWS
        self.in_features = codes.shape[1] * W4A8_GROUP

    @classmethod
    def from_groups(cls, blocks: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                    bias: torch.Tensor | None) -> W4A8Linear:
        """Blocks of rows of (codes [n, K] in [0, 15], scales [n, K/32], zeros [n, K/32]) in the int4 layers'
        convention w = (code - 8) * scale + zero, the one GGUF Q4_K groups and min-max quantization give."""
        parts = []
        for codes, scales, zeros in rows_in_multiples(blocks, _TILE_ROWS):
            if not w4a8_fits(*codes.shape):
                raise SpecDecodeError(f"w4a8 needs output sizes divisible by {_TILE_ROWS} and input sizes by "
                                      f"{W4A8_GROUP}; a layer has {codes.shape[0]} x {codes.shape[1]}")
            parts.append(pack_tiles(codes, scales.float(), zeros.float() - 8 * scales.float()))
        return cls(*(torch.cat(part) for part in zip(*parts)), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()  # [R, K]: the kernel reads float32 rows
        kernel = _kernel or load_kernel()
        out = kernel.w4a8_mm(flat, self.codes, self.group_scales, self.block_scales).to(x.dtype)  # [R, N]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)
