"""What a trunk's layers need to run the compiled fixed-order attention (attention.cpp), shared by the hybrid and
Gemma 4 trunks: the kernel's reach, and every matmul of a layer for the row-invariance probes."""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.kernels.w4a8_moe import W4A8MoEBlock

_DTYPES = (torch.float32, torch.bfloat16)


def attention_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the fixed-order attention cannot run a cache of this device, dtype and head size here, or None."""
    if device.type != "cpu" or dtype not in _DTYPES:
        return f"the fixed-order attention runs on the CPU in bfloat16 or float32, not {device.type} {dtype}"
    if head_dim % 16:
        return f"the fixed-order attention needs a head size that is a multiple of 16, not {head_dim}"
    reason = w4a8_unavailable()
    return None if reason is None else f"the attention kernel is unavailable: {reason}"


def layer_linears(layer: nn.Module) -> list[nn.Module]:
    """Every matmul of a layer that PyTorch runs, whatever its kind (nn.Linear, packed, quantized: each has
    in_features); not those of a compiled mixture of experts, which runs them itself (w4a8_moe.py)."""
    compiled = {id(module) for block in layer.modules() if isinstance(block, W4A8MoEBlock)
                for module in block.modules()}
    return [module for module in layer.modules()
            if hasattr(module, "in_features") and not list(module.children()) and id(module) not in compiled]
