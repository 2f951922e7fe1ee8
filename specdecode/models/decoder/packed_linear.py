"""Linear layers with their weights prepacked once for oneDNN (CPU, bfloat16 and float32).

`F.linear` on a plain bf16 weight has oneDNN reorder the weight into its blocked layout on every call; for
decoding (a handful of rows against a large weight) that reorder costs about as much as the product itself.
Packing once at load time keeps each call a single pass over the weight. For float32, oneDNN's packed product
is 1.5-3x faster here than `F.linear`'s MKL one at 1-16 rows.

Batch invariance: oneDNN sums each output of 2 or more rows in the same order whatever the number of rows (every
row bitwise at 2 to 320 rows on the default target's shapes here; `rows_invariant` checks up to 80 at load), but
takes another kernel, with another order, for a single row. A single row is therefore computed as two copies of itself (decoding is memory-bound: the copy is free),
and a token's outputs are then bitwise the same alone or among other rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def can_pack(model: nn.Module) -> bool:
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and (weight.dtype == torch.float32
             or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()))
    )


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # A plain attribute, not a parameter: oneDNN's blocked layout is not a weight anyone should save.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.numel() != x.shape[-1]:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        rows = x.reshape(1, -1).expand(2, -1).contiguous()  # [2, in]: see the module's docstring
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")  # [2, out]
        return out[:1].reshape(*x.shape[:-1], self.out_features)


def rows_invariant(linear: nn.Module, generator: torch.Generator, dtype: torch.dtype, most_rows: int = 80) -> bool:
    """Whether `linear` (packed or not) gives each row bitwise the same outputs at 1, 2, 3, 8, 17 and `most_rows`
    rows of `dtype` on this CPU (kernels differ by instruction set; the ones measured so far are invariant)."""
    x = torch.randn(most_rows, linear.in_features, generator=generator).to(dtype)  # [R, in]
    with torch.inference_mode():
        alone = torch.cat([linear(x[r : r + 1]) for r in range(3)])  # [3, out]
        return all(torch.equal(linear(x[:rows])[:3], alone[:rows]) for rows in (2, 3, 8, 17, most_rows))


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace every nn.Linear in `model` (the output head included) by make(linear), in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))


def pack_linears(model: nn.Module) -> None:
    replace_linears(model, PackedLinear)
