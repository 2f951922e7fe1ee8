"""Weight-only int8 (per output channel) and int4 (group-wise, asymmetric) linear layers on PyTorch's kernels.

Decoding on CPU is bound by the bytes of weight streamed per token: int8 halves them against bf16 and int4
quarters them. Activations stay in the model's dtype. A quantized model is a different model from its float
self: greedy identity holds against the model as loaded, quantization included.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.packed_linear import replace_linears

QUANT_MODES = ("none", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the int4 CPU kernel supports


def check_quant(mode: str, group_size: int) -> None:
    if mode not in QUANT_MODES:
        raise SpecDecodeError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    if mode == "int4" and group_size not in INT4_GROUP_SIZES:
        raise SpecDecodeError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                              f"got {group_size}")


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()  # [N, K]
        scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127  # [N]
        self.register_buffer("weight", torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = linear.bias
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [R, K]: the kernel takes 2-D activations
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)  # [R, N]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """4-bit codes q in [0, 15] per group of `group_size` inputs: w = (q - 8) * scale + zero."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bias: torch.Tensor | None,
                 group_size: int, dtype: torch.dtype):
        """codes [N, K] int32 in [0, 15]; scales, zeros [N, K/G]; the kernel wants them in the activations' dtype."""
        super().__init__()
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1)  # [K/G, N, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().to(dtype))
        self.group_size = group_size
        self.bias = bias
        self.out_features = codes.shape[0]

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> Int4Linear:
        """Min-max quantization of each group of a float weight."""
        out_features, in_features = linear.weight.shape
        if in_features % group_size:
            raise SpecDecodeError(f"int4 needs input sizes divisible by the group size {group_size}; "
                                  f"a layer has {in_features}")
        groups = linear.weight.detach().float().reshape(out_features, in_features // group_size, group_size)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, K/G] each
        scales = ((high - low) / 15).clamp_min(1e-12)  # [N, K/G]
        codes = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)  # [N, K/G, G]
        codes = codes.to(torch.int32).reshape(out_features, in_features)  # [N, K]
        zeros = low + 8 * scales  # [N, K/G]: moves the kernel's (q - 8) back to low + q * scale
        return cls(codes, scales, zeros, linear.bias, group_size, linear.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [R, K]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size,
                                                          self.scales_and_zeros)  # [R, N]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears(model: nn.Module, mode: str, group_size: int = 32) -> None:
    """Replace every nn.Linear (the output head included) by its quantized form, in place."""
    check_quant(mode, group_size)
    if mode == "none":
        return
    if next(model.parameters()).device.type != "cpu":
        raise SpecDecodeError(f"--quant {mode} runs on the CPU kernels; use --device cpu or --quant none")
    replace_linears(model, Int8Linear if mode == "int8" else lambda linear: Int4Linear.from_linear(linear, group_size))
