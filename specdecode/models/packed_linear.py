"""Linear layers with their weights prepacked once for oneDNN (CPU, bf16).

`F.linear` on a plain bf16 weight has oneDNN reorder the weight into its blocked layout on every call; for
decoding (a handful of rows against a large weight) that reorder costs about as much as the product itself.
Packing once at load time keeps each call a single pass over the weight, with bitwise the same results.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def can_pack(model: nn.Module) -> bool:
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # A plain attribute, not a parameter: oneDNN's blocked layout is not a weight anyone should save.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace every nn.Linear in `model` (the output head included) by make(linear), in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))


def pack_linears(model: nn.Module) -> None:
    replace_linears(model, PackedLinear)
