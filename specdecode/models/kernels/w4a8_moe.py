"""Mixture-of-experts blocks with w4a8 experts run as one C++ call each (w4a8_moe.cpp), inside a fused decoder
layer (w4a8_decoder.py) or alone where the family's attention runs in PyTorch (latent attention, partial rotary,
the hybrid trunk's layers).

At one token a step the PyTorch block (decoder/moe.py) runs a few dozen small ops a layer: the router's, then for
each of the k chosen experts its two matmuls, SiLU, a gather, a weighting and a scatter. On Qwen3-30B-A3B's
widths that dispatch cost more than the experts' matmuls themselves, and our decoding ran at 0.79 of llama.cpp's
(docs/benchmarks, 2026-12-06). The kernel computes the same block: the same routing rules, each chosen expert once
over all of its rows, each row's k weighted outputs summed in slot order in float32; every row on its own, so the
block stays batch-invariant. Its router's logits are fixed-order float32 dot products (the PyTorch block's run on
oneDNN, in the model's dtype for Qwen), and its SiLU is the fused layers' own: the outputs agree with the PyTorch
block's within float rounding, not bit for bit (tests/models/test_w4a8_moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.layers import MLP
from specdecode.models.decoder.moe import MoEBlock, Router
from specdecode.models.kernels.quantized_linear import Int8Linear
from specdecode.models.kernels.w4a8_linear import W4A8Linear, load_kernel


class W4A8MoEBlock(MoEBlock):
    """A MoE block whose forward is one C++ call; the same submodules as the block it replaces, so saved weights
    keep their names."""

    def __init__(self, block: MoEBlock, kernel_block):
        nn.Module.__init__(self)
        self.router, self.experts, self.shared, self.shared_gate = (block.router, block.experts, block.shared,
                                                                    block.shared_gate)
        self.compiled = kernel_block  # the compiled block: it holds the experts' packed tensors
        self.last_touched = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        rows = x.reshape(-1, x.shape[-1]).float().contiguous()  # [N, H]: the kernel reads float32 rows
        out, _ = self.compiled.forward(rows)  # [N, H] float32, [N, k] experts
        return out.to(x.dtype).view_as(x)


def moe_kernel(block: MoEBlock):
    """The compiled form of `block` (the kernel's MoE), or None where a matmul of its experts is not w4a8 or the
    kernel does not compute it (its experts are SwiGLU, its routing the shared Router's: not Gemma 4's)."""
    mlps = [*block.experts, *([block.shared] if block.shared is not None else [])]
    if block.router.moe.activation != "silu" or type(block.router) is not Router:
        return None
    if not all(isinstance(linear, W4A8Linear) for mlp in mlps for linear in (mlp.gate_up, mlp.down)):
        return None
    kernel, moe, router = load_kernel(), block.router.moe, block.router

    def detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.detach().float()

    shared: MLP | None = block.shared
    router.in_kernel = True  # its logits run in the kernel: nothing to pack for oneDNN (pack_routers)
    return kernel.MoE(
        detached(router.weight), detached(router.score_bias), [e.gate_up.kernel_weight() for e in block.experts],
        [e.down.kernel_weight() for e in block.experts], None if shared is None else shared.gate_up.kernel_weight(),
        None if shared is None else shared.down.kernel_weight(),
        None if block.shared_gate is None else float_weight(block.shared_gate).flatten(),
        moe.experts_per_token, moe.scoring == "sigmoid", moe.groups, moe.groups_kept, moe.renormalize,
        moe.scaling)


def float_weight(linear: nn.Module) -> torch.Tensor:
    """A float or int8 linear layer's weight [N, K] as float32: the shared gate's one row, which no w4a8 tile fits
    (quantizers leave it in float or give it int8 codes, one scale a row)."""
    if isinstance(linear, Int8Linear):
        return linear.weight.float() * linear.scales.float()[:, None]
    return linear.weight.detach().float()


def fuse_moe_blocks(model: nn.Module) -> None:
    """Replace every MoE block of `model` (its trunk's and its MTP modules') whose experts are all w4a8, and whose
    router a fused decoder layer does not already run, by a W4A8MoEBlock. Call before `finish_loading`, which
    packs the routers left in PyTorch."""
    for name, module in list(model.named_modules()):
        if type(module) is not MoEBlock or module.router.in_kernel or model.config.hidden_size % 16:
            continue
        kernel_block = moe_kernel(module)
        if kernel_block is not None:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, W4A8MoEBlock(module, kernel_block))
