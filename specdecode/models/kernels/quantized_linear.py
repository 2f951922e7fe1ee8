"""Weight-only int8 (per output channel) and int4 (group-wise, asymmetric) linear layers on PyTorch's kernels.

Decoding on CPU is bound by the bytes of weight streamed per token: int8 halves them against bf16 and int4
quarters them. Activations stay in the model's dtype. A quantized model is a different model from its float
self: greedy identity holds against the model as loaded, quantization included.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from specdecode.errors import SpecDecodeError

_INT4_PACK_ROWS = 64  # the int4 CPU packing lays out rows in blocks of 64, with a differently laid-out tail
# w4a8: int4 weights, int8 activations (w4a8_linear.py); w3a8: the same kernel with 3-bit weights, for drafts
QUANT_MODES = ("none", "int8", "int4", "w4a8", "w3a8")
# The clipping ranges searched_groups tries: shares of a group's max - min, and shifts of the range's centre by
# shares of its half-width (35 candidates; at 3 bits min-max alone cost a draft 4 points of acceptance, this 1.4).
CLIP_SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
CLIP_SHIFTS = (-0.1, -0.05, 0.0, 0.05, 0.1)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 CPU kernel supports
# torch's int8 CPU kernel (torch 2.13) reads past the end of each row in bfloat16 when K is not a multiple of 16:
# garbage outputs, NaN or a crash. Such layers run with zero columns appended, which add nothing to the sums.
_INT8_K_MULTIPLE = 16


def row_blocks_of(weight: torch.Tensor, size: int = 4096) -> Iterator[torch.Tensor]:
    """A weight [N, K] as blocks of rows, so that float temporaries stay one block in size."""
    return (weight[start : start + size] for start in range(0, weight.shape[0], size))


def rows_in_multiples(blocks: Iterable[tuple[torch.Tensor, ...]], multiple: int) -> Iterator[tuple[torch.Tensor, ...]]:
    """The same rows regrouped so that every block but the last holds a multiple of `multiple` rows."""
    carry: tuple[torch.Tensor, ...] | None = None
    for block in blocks:
        if carry is not None:
            block = tuple(torch.cat([c, b]) for c, b in zip(carry, block))
        whole = len(block[0]) - len(block[0]) % multiple
        if whole:
            yield tuple(b[:whole] for b in block)
        carry = tuple(b[whole:] for b in block) if whole < len(block[0]) else None
    if carry is not None:
        yield carry


def _scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K/G] each -> [K/G, N, 2] in the activations' dtype, the int4 kernel's layout."""
    return torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)


def _check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    if in_features % group_size:
        raise SpecDecodeError(f"int4 needs input sizes divisible by the group size {group_size}; "
                              f"a layer has {in_features}")
    if out_features % 16:
        raise SpecDecodeError(f"int4 needs output sizes divisible by 16 (the CPU kernel's tile); a layer has "
                              f"{out_features}: use --quant int8")


def int4_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the int4 CPU kernel can take a weight [out, in]: whole 16-row tiles and whole groups."""
    return out_features % 16 == 0 and in_features % group_size == 0


def check_quant(mode: str, group_size: int) -> None:
    if mode not in QUANT_MODES:
        raise SpecDecodeError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        raise SpecDecodeError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                              f"got {group_size}")
    if mode in ("w4a8", "w3a8") and group_size != 32:
        raise SpecDecodeError(f"{mode} uses groups of 32 (its kernel's); got --group-size {group_size}")


def minmax_groups(block: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max int4 quantization of each group of a block of rows [n, K]: codes [n, K] in [0, 15], and the
    scales and zeros [n, K/G] of w = (q - 8) * scale + zero."""
    rows, in_features = block.shape
    groups = block.detach().float().reshape(rows, in_features // group_size, group_size)  # [n, K/G, G]
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [n, K/G] each
    scales = ((high - low) / 15).clamp_min(1e-12)  # [n, K/G]
    codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)  # [n, K/G, G]
    # the zero moves the kernel's (q - 8) back to low + q * scale
    return codes.to(torch.int32).reshape(rows, in_features), scales, low + 8 * scales


def searched_groups(block: torch.Tensor, bits: int, group_size: int = 32,
                    search: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group of a block of rows [n, K] at `bits` bits over the range, among CLIP_SHRINKS x CLIP_SHIFTS of its
    min-max one, with the least squared error (only min-max where not `search`) -> codes [n, K] int32 in
    [0, 2^bits - 1], scales and offsets [n, K/G] with w = code * scale + offset."""
    rows, in_features = block.shape
    groups = block.detach().float().reshape(rows, in_features // group_size, group_size)  # [n, G, g]
    top = 2**bits - 1
    low, high = groups.amin(-1), groups.amax(-1)  # [n, G] each
    best_codes = torch.zeros_like(groups)  # [n, G, g]
    best_scales, best_starts = torch.zeros_like(low), torch.zeros_like(low)  # [n, G] each
    best_error = torch.full_like(low, float("inf"))  # [n, G]
    for shrink in CLIP_SHRINKS if search else (1.0,):
        for shift in CLIP_SHIFTS if search else (0.0,):
            half = (high - low) / 2 * shrink  # [n, G]
            start = (high + low) / 2 + (shift - 1) * half  # [n, G]: the range's lowest value
            scale = (2 * half / top).clamp_min(1e-12)  # [n, G]
            codes = torch.round((groups - start[..., None]) / scale[..., None]).clamp(0, top)  # [n, G, g]
            error = ((codes * scale[..., None] + start[..., None] - groups) ** 2).sum(-1)  # [n, G]
            better = error < best_error  # [n, G]
            best_codes = torch.where(better[..., None], codes, best_codes)
            best_scales, best_starts = torch.where(better, scale, best_scales), torch.where(better, start, best_starts)
            best_error = torch.minimum(error, best_error)
    return best_codes.to(torch.int32).reshape(rows, in_features), best_scales, best_starts


class Int8Linear(nn.Module):
    """int8 codes with one scale per output channel: w = q * scale."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        """weight [N, K] int8; scales [N] in the activations' dtype."""
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias.detach() if bias is not None else None)  # saved with the layer
        self.out_features = weight.shape[0]
        self.in_features = weight.shape[1]
        pad = -self.in_features % _INT8_K_MULTIPLE
        # [N, K + pad]: what the kernel multiplies; derived, so kept out of the saved state
        self.register_buffer("kernel_weight", nn.functional.pad(weight, (0, pad)) if pad else None, persistent=False)

    @classmethod
    def from_blocks(cls, blocks: Iterable[torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype) -> Int8Linear:
        """Symmetric round-to-nearest of a float weight given as blocks of rows [n, K], one scale per row."""
        codes, scales = [], []
        for block in blocks:
            block = block.detach().float()  # [n, K]
            scale = block.abs().amax(dim=1).clamp_min(1e-12) / 127  # [n]
            codes.append(torch.round(block / scale[:, None]).clamp(-127, 127).to(torch.int8))
            scales.append(scale)
        return cls(torch.cat(codes), torch.cat(scales).to(dtype), bias)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Int8Linear:
        return cls.from_blocks(row_blocks_of(weight), bias, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls.from_weight(linear.weight, linear.bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [R, K]: the kernel takes 2-D activations
        weight = self.weight
        if self.kernel_weight is not None:
            weight = self.kernel_weight
            flat = nn.functional.pad(flat, (0, weight.shape[1] - self.in_features))  # [R, K + pad]
        out = torch.ops.aten._weight_int8pack_mm(flat, weight, self.scales)  # [R, N]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """4-bit codes q in [0, 15] per group of `group_size` inputs: w = (q - 8) * scale + zero."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int):
        """packed: the CPU kernel's layout of the codes; scales_and_zeros [K/G, N, 2] in the activations' dtype."""
        super().__init__()
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.group_size = group_size
        self.register_buffer("bias", bias.detach() if bias is not None else None)  # saved with the layer
        self.out_features = scales_and_zeros.shape[1]

    @classmethod
    def from_groups(cls, blocks: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bias: torch.Tensor | None,
                    group_size: int, dtype: torch.dtype) -> Int4Linear:
        """Blocks of rows of (codes [n, K] int32 in [0, 15], scales [n, K/G], zeros [n, K/G])."""
        packed, scales, zeros = [], [], []
        # Packing blocks separately equals packing the whole only at 64-row boundaries.
        for codes, block_scales, block_zeros in rows_in_multiples(blocks, _INT4_PACK_ROWS):
            _check_int4_shape(*codes.shape, group_size)
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
            scales.append(block_scales)
            zeros.append(block_zeros)
        return cls(torch.cat(packed), _scales_and_zeros(torch.cat(scales), torch.cat(zeros), dtype), bias, group_size)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int,
                    dtype: torch.dtype) -> Int4Linear:
        _check_int4_shape(*weight.shape, group_size)
        return cls.from_groups((minmax_groups(block, group_size) for block in row_blocks_of(weight)), bias,
                               group_size, dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        return cls.from_weight(linear.weight, linear.bias, group_size, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [R, K]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size,
                                                          self.scales_and_zeros)  # [R, N]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)
