"""Linear layers with their weights prepacked once for oneDNN (CPU, bfloat16 and float32).

`F.linear` on a plain bf16 weight has oneDNN reorder the weight into its blocked layout on every call; for
decoding (a handful of rows against a large weight) that reorder costs about as much as the product itself.
Packing once at load time keeps each call a single pass over the weight. For float32, oneDNN's packed product
is 1.5-3x faster here than `F.linear`'s MKL one at 1-16 rows.

Batch invariance: oneDNN sums each output of 2 or more rows in the same order whatever the number of rows (every
row bitwise at 2 to 320 rows on the default target's shapes here; `rows_invariant` checks up to 80 at load), but
takes another kernel, with another order, for a single row. A single row is therefore computed as two copies of
itself (decoding is memory-bound: the copy is free), and a token's outputs are then bitwise the same alone or among
other rows.

Fewest rows: on a CPU with native bf16 dot products (avx512_bf16, or AMX), oneDNN's bf16 product of 1-3 rows is
slower than of 4 (AMD EPYC, AVX-512 BF16, 2 threads: the output head 23 ms at 1-2 rows against 14 ms at 4, the
gate and up projections 2.3 against 1.8 ms; the 1.5B target's forward 164 ms at 1 row, 126 ms at 4-6), so bf16
rows are padded to 4 there (copies of the first: the same order of sums as above, the same bits). Without native
bf16 (AVX-512 VNNI alone) 4 rows cost more than 2 (the head 48 against 35 ms), and float32 is left as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from torch import nn

from specdecode.models.cpu_features import cpu_flags

INVARIANT_ROWS = 2  # fewer rows run with another order of sums: a single row is computed as two (docstring)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo's names
FAST_BF16_ROWS = 4  # where a flag above is present: fewer bf16 rows are padded to this many


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
        self.fewest_rows = fewest_rows(linear.weight.dtype)  # see the module's docstring

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        rows = x.reshape(-1, self.in_features)  # [M, in]
        count = rows.shape[0]
        if count >= self.fewest_rows or count == 0:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        padded = torch.cat([rows, rows[:1].expand(self.fewest_rows - count, -1)])  # [fewest_rows, in]
        out = torch.ops.mkldnn._linear_pointwise(padded, self.packed_weight, self.bias, "none", [], "")  # [F, out]
        return out[:count].reshape(*x.shape[:-1], self.out_features)


def fewest_rows(dtype: torch.dtype) -> int:
    """The fewest rows a packed product of `dtype` runs with (see the module's docstring)."""
    return FAST_BF16_ROWS if dtype == torch.bfloat16 and native_bf16() else INVARIANT_ROWS


@cache
def native_bf16() -> bool:
    """Whether this CPU has bf16 dot products (read once: a model packs hundreds of layers)."""
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


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
