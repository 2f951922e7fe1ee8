"""Quantize the linear layers of a module already in memory (a drafter's own float weights, such as an EAGLE-3
head), in place: the layers and kernels a quantized model uses (quantized_model.quantized_from_rows), from
min-max groups of the float weights. A drafter's precision never changes the output, only how often its drafts
are accepted and what they cost."""

from __future__ import annotations

from torch import nn

from specdecode.models.quant.quantized_linear import row_blocks_of
from specdecode.models.quant.quantized_model import quantized_from_rows
from specdecode.models.quant.w4a8_linear import W4A8_GROUP

GROUP = W4A8_GROUP  # inputs per group for int4 too: the one size w4a8's kernel takes


def quantize_linears(module: nn.Module, quant: str) -> int:
    """Replace every nn.Linear inside `module` by its `quant` form ("none", "int8", "int4", "w4a8"; a layer whose
    shape the kernel does not take becomes int8, as in a quantized model) -> how many were replaced."""
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
