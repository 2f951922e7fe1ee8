"""Quantize the linear layers of a module already in memory (a drafter's own float weights, such as an EAGLE-3
head), in place: the layers and kernels a quantized model uses, from min-max groups of the float weights. A
drafter's precision never changes the output, only how often its drafts are accepted and what they cost."""

from __future__ import annotations

from torch import nn

from specdecode.models.quant.quantized_linear import (Int4Linear, Int8Linear, int4_fits, minmax_groups,
                                                      row_blocks_of)
from specdecode.models.quant.w4a8_linear import W4A8_GROUP, W4A8Linear, w4a8_fits

GROUP = W4A8_GROUP  # inputs per group for int4 too: the one size w4a8's kernel takes


def quantize_linears(module: nn.Module, quant: str) -> int:
    """Replace every nn.Linear inside `module` whose shape `quant` ("none", "int8", "int4", "w4a8") takes by
    its quantized form -> how many were replaced (a layer that does not fit stays float)."""
    if quant == "none":
        return 0
    replaced = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and _fits(child, quant):
                setattr(parent, name, _quantized(child, quant))
                replaced += 1
    return replaced


def _fits(layer: nn.Linear, quant: str) -> bool:
    if quant == "w4a8":
        return w4a8_fits(layer.out_features, layer.in_features)
    if quant == "int4":
        return int4_fits(layer.out_features, layer.in_features, GROUP)
    return True


def _quantized(layer: nn.Linear, quant: str) -> nn.Module:
    weight, bias = layer.weight.detach(), layer.bias  # weight [N, K]
    if quant == "int8":
        return Int8Linear.from_blocks(row_blocks_of(weight), bias, weight.dtype)
    groups = (minmax_groups(block, GROUP) for block in row_blocks_of(weight))
    if quant == "w4a8":
        return W4A8Linear.from_groups(groups, bias)
    return Int4Linear.from_groups(groups, bias, GROUP, weight.dtype)
