"""Weight-only int8 (per output channel) and int4 (group-wise, asymmetric) linear layers on PyTorch's kernels.

Decoding on CPU is bound by the bytes of weight streamed per token: int8 halves them against bf16 and int4
quarters them. Activations stay in the model's dtype. A quantized model is a different model from its float
self: greedy identity holds against the model as loaded, quantization included.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.errors import SpecDecodeError

QUANT_MODES = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 CPU kernel supports


def _row_chunks(rows: int, size: int = 4096) -> list[slice]:
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


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


class Int8Linear(nn.Module):
    """int8 codes with one scale per output channel: w = q * scale."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        """weight [N, K] int8; scales [N] in the activations' dtype."""
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", bias.detach() if bias is not None else None)  # saved with the layer
        self.out_features = weight.shape[0]

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Int8Linear:
        """Symmetric round-to-nearest of a float weight [N, K], one scale per row."""
        codes = torch.empty(weight.shape, dtype=torch.int8)  # [N, K]
        scales = torch.empty(weight.shape[0])  # [N]
        for rows in _row_chunks(weight.shape[0]):  # float temporaries stay one chunk in size
            chunk = weight[rows].detach().float()  # [n, K]
            scales[rows] = chunk.abs().amax(dim=1).clamp_min(1e-12) / 127
            codes[rows] = torch.round(chunk / scales[rows, None]).clamp(-127, 127).to(torch.int8)
        return cls(codes, scales.to(dtype), bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls.from_weight(linear.weight, linear.bias, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [R, K]: the kernel takes 2-D activations
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)  # [R, N]
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
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                   group_size: int, dtype: torch.dtype) -> Int4Linear:
        """codes [N, K] int32 in [0, 15]; scales, zeros [N, K/G]."""
        _check_int4_shape(*codes.shape, group_size)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        return cls(packed, _scales_and_zeros(scales, zeros, dtype), bias, group_size)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int,
                    dtype: torch.dtype) -> Int4Linear:
        """Min-max quantization of each group of a float weight [N, K]."""
        out_features, in_features = weight.shape
        _check_int4_shape(out_features, in_features, group_size)
        packed = []  # the packed layout is row by row, so chunks pack separately and stack
        scales = torch.empty(out_features, in_features // group_size)  # [N, K/G]
        zeros = torch.empty_like(scales)  # [N, K/G]
        for rows in _row_chunks(out_features):  # float and int32 temporaries stay one chunk in size
            groups = weight[rows].detach().float().reshape(-1, in_features // group_size, group_size)  # [n, K/G, G]
            low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [n, K/G] each
            scales[rows] = ((high - low) / 15).clamp_min(1e-12)
            codes = torch.round((groups - low[..., None]) / scales[rows, :, None]).clamp(0, 15)  # [n, K/G, G]
            packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32).reshape(-1, in_features), 1))
            zeros[rows] = low + 8 * scales[rows]  # moves the kernel's (q - 8) back to low + q * scale
        return cls(torch.cat(packed), _scales_and_zeros(scales, zeros, dtype), bias, group_size)

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
