"""A w4a8 model's decoder layers run as one C++ call each (w4a8_layer.cpp).

At one token per forward the w4a8 matmuls took about 31 of a 40 ms step on the 1.5B target, and most of the
rest was some 60 small PyTorch ops per layer (norms, rope, cache writes, attention, dtype conversions) at a few
microseconds of dispatch each. With one call per layer the rest is under a millisecond.

It also makes the whole forward batch-invariant: each token is computed on its own, its attention summing its
visible slots in slot order, so a token's logits are bitwise the same whether it is decoded alone, verified in
a chain of drafted tokens, or placed in a tree or a batch (tested). With a w4a8 output head as well, every
method's greedy output is then bitwise the target's plain decoding, in bfloat16 too.

The residual stream stays in float32 inside the layers; hidden states handed to callers are cast to the model's
dtype like every other model's.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.layers import DecoderLayer
from specdecode.models.decoder.moe import MoEBlock
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.kernels.float_decoder import fix_float_layers
from specdecode.models.kernels.w4a8_linear import W4A8Linear, load_kernel
from specdecode.models.kernels.w4a8_moe import fuse_moe_blocks, moe_kernel

CACHE_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ attention reads and writes


class W4A8DecoderLayer(DecoderLayer):
    """A decoder layer whose whole forward is one C++ call; the same submodules as the layer it replaces, so
    saved weights keep their names."""

    rope_dtype = torch.float32  # the C++ rope reads float32 cos/sin

    def __init__(self, layer: DecoderLayer, kernel_layer):
        nn.Module.__init__(self)
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = layer.attn_norm, layer.attn, layer.mlp_norm, layer.mlp
        self.kernel_layer = kernel_layer  # the compiled layer: it holds the weights' packed tensors

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | CacheBatch,
                index: int, mask: torch.Tensor | None) -> torch.Tensor:
        # The residual stream stays float32 between fused layers (a no-op after the first one).
        keys, values = cache.layer_views(index)  # one [Hkv, S, D] tensor each per sequence
        return self.kernel_layer.forward(x.float(), keys, values, cache.lengths, cos, sin, mask)


def fuse_layers(model: Transformer) -> None:
    """Replace each Llama-style decoder layer by a fused one when every matmul in them is w4a8 (a mixture of
    experts' included: w4a8_moe.py) and the sizes suit the vector code (else the PyTorch layers run). Call before
    `finish_loading`, which builds the cos/sin table in the dtype the layers want."""
    layers, config = model.layers, model.config
    attention = [m for layer in layers for m in (layer.attn.qkv, layer.attn.o)]
    if not attention or not all(isinstance(m, W4A8Linear) for m in attention):
        return
    # The C++ rope turns whole heads: partial rotary (GLM-4.5) keeps the PyTorch attention.
    if (model.dtype not in CACHE_DTYPES or config.head_dim % 16  # w4a8 shapes already make the other sizes fit
            or config.rotary_dim not in (None, config.head_dim)):
        return
    kernel = load_kernel()

    def feedforward(mlp: nn.Module) -> tuple | None:
        """The kernel's arguments for a layer's MLP (gate_up, down, experts): its two w4a8 weights, or a compiled
        mixture of experts."""
        if isinstance(mlp, MoEBlock):
            mlp.compiled = moe_kernel(mlp)  # the fused layer runs it: the block's tally reads it (moe.py)
            return None if mlp.compiled is None else (None, None, mlp.compiled)
        if all(isinstance(linear, W4A8Linear) for linear in (mlp.gate_up, mlp.down)):
            return mlp.gate_up.kernel_weight(), mlp.down.kernel_weight(), None
        return None

    feedforwards = [feedforward(layer.mlp) for layer in layers]
    if any(arguments is None for arguments in feedforwards):
        for layer in layers:
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.router.in_kernel, layer.mlp.compiled = False, None  # left to PyTorch after all
        return

    def norm_weight(norm: nn.Module | None) -> torch.Tensor | None:
        return None if norm is None else norm.weight.detach()

    model.layers = nn.ModuleList(
        W4A8DecoderLayer(layer, kernel.DecoderLayer(
            layer.attn_norm.weight.detach(), layer.attn.qkv.kernel_weight(), layer.attn.o.kernel_weight(),
            layer.mlp_norm.weight.detach(), *mlp, norm_weight(layer.attn.q_norm), norm_weight(layer.attn.k_norm),
            config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps))
        for layer, mlp in zip(layers, feedforwards, strict=True))


def fuse_moe_layers(model: Transformer) -> None:
    """A Llama-style trunk with mixtures of experts: its layers fused where they can be (fuse_layers), the MoE
    blocks they do not run (its MTP modules', or every one where the attention stays in PyTorch) compiled on their
    own, and unfused layers on the fixed-order float layers (float_decoder.py) over the w4a8 matmuls."""
    fuse_layers(model)
    fuse_moe_blocks(model)
    if not all(isinstance(layer, W4A8DecoderLayer) for layer in model.layers):
        fix_float_layers(model)


def fused_batch_invariant(model: Transformer) -> bool:
    """Every decoder layer fused with a w4a8 output head: each token computed on its own (see above)."""
    return all(isinstance(layer, W4A8DecoderLayer) for layer in model.layers) and isinstance(model.lm_head, W4A8Linear)
