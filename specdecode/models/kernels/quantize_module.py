"""Quantize the linear layers of a module already in memory (a drafter's own float weights, such as an EAGLE-3 head),
in place: the layers and kernels a quantized model uses (quantized_from_rows, which quantized_model.py builds whole
models with), from min-max groups of the float weights. A drafter's precision never changes the output, only how
often its drafts are accepted and what they cost."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from specdecode.models.kernels.quantized_linear import Int4Linear, Int8Linear, int4_fits, minmax_groups, row_blocks_of
from specdecode.models.kernels.w4a8_linear import W4A8_GROUP, W4A8Linear, w4a8_fits

GROUP = W4A8_GROUP  # inputs per group for int4 too: the one size w4a8's kernel takes


def quantize_linears(module: nn.Module, quant: str) -> int:
    """Replace every nn.Linear inside `module` by its `quant` form ("none", "int8", "int4", "w4a8", "w3a8"; a
    layer whose shape the kernel does not take becomes int8, as in a quantized model) -> how many were replaced."""
    if quant == "none":
        return 0
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                weight = child.weight.detach()  # [N, K]
                setattr(parent, name, quantized_from_rows(tuple(weight.shape), lambda w=weight: row_blocks_of(w),
                                                          child.bias, quant, GROUP, weight.dtype))
                replaced += 1
    return replaced


def quantized_from_rows(shape: tuple[int, int], rows: Callable[[], Iterable[torch.Tensor]], bias: torch.Tensor | None,
                        quant: str, group_size: int, dtype: torch.dtype,
                        groups: Callable[[], Iterable[tuple[torch.Tensor, ...]]] | None = None) -> nn.Module:
    """A linear layer of a float weight of `shape` [N, K], read as blocks of rows by `rows()`: in `quant` where
    the shape fits its kernel, else int8 per channel. `groups()`: int4 groups already at hand (a GGUF's Q4_K
    codes), used instead of min-max groups of the float rows."""
    fits = w4a8_fits(*shape) if quant in ("w4a8", "w3a8") else int4_fits(*shape, group_size)
    if quant == "int8" or not fits:
        return Int8Linear.from_blocks(rows(), bias, dtype)
    if quant == "w3a8":  # from the float rows: a GGUF's 4-bit codes do not give 3-bit ones
        return W4A8Linear.from_rows(rows(), bias, bits=3)
    int4_groups = groups() if groups is not None else (minmax_groups(block, group_size) for block in rows())
    if quant == "w4a8":
        return W4A8Linear.from_groups(int4_groups, bias)
    return Int4Linear.from_groups(int4_groups, bias, group_size, dtype)
