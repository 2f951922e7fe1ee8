"""A w4a8 latent-attention model's decoder layers run as one C++ call each (w4a8_latent.cpp), as the Llama-style
ones do (w4a8_decoder.py).

In PyTorch, the fixed-order latent attention (decoder/mla.py) took about 80 small ops a layer at one token: dtype
conversions around each of its w4a8 matmuls, four norms, two ropes, concatenations and scalings. On GLM-4.7-Flash's
widths that left our decoding at 0.90 of llama.cpp's on the same file (docs/benchmarks, 2026-12-06). The fused layer
computes the same fixed-order absorbed form, every row on its own, so the model stays batch-invariant; its norms,
rope and scaling run in float32 where the PyTorch form rounds to the model's dtype between ops, so the two agree
within that rounding, not bit for bit (tests/models/families/test_mla.py). The MTP modules keep the PyTorch form.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.layers import MLP, DecoderLayer
from specdecode.models.decoder.mla import LatentAttention
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.kernels.w4a8_decoder import CACHE_DTYPES, W4A8DecoderLayer
from specdecode.models.kernels.w4a8_linear import W4A8Linear, load_kernel
from specdecode.models.kernels.w4a8_moe import W4A8MoEBlock


class W4A8LatentDecoderLayer(W4A8DecoderLayer):
    """A latent-attention decoder layer whose whole forward is one C++ call: as the Llama-style fused layer (the
    same submodules as the layer it replaces, float32 cos/sin), over a latent cache."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | CacheBatch,
                index: int, mask: torch.Tensor | None) -> torch.Tensor:
        rows, _ = cache.layer_views(index)  # one [1, S, C + R] tensor per sequence: keys and values alike
        return self.kernel_layer.forward(x.float(), rows, cache.lengths, cos, sin, mask)


def fuse_latent_layers(model: Transformer) -> None:
    """Replace each latent-attention decoder layer by a fused one where its attention's matmuls are w4a8, its
    experts compiled (w4a8_moe.py) or its MLP w4a8, and the sizes suit the vector code; else the layers stay. Call
    after the attention took its fixed-order form (which lays out the per-head weights) and before
    `finish_loading`, which builds the cos/sin table in the dtype the layers want."""
    config, layers = model.config, model.layers
    mla = config.mla
    if (model.dtype not in CACHE_DTYPES or config.hidden_size % 16 or mla.kv_lora_rank % 16 or mla.width % 16
            or (mla.q_lora_rank or 0) % 16):
        return
    kernel = load_kernel()
    arguments = [_layer_arguments(layer) for layer in layers]
    if any(each is None for each in arguments):
        return
    model.layers = nn.ModuleList(W4A8LatentDecoderLayer(layer, kernel.LatentLayer(*each))
                                 for layer, each in zip(layers, arguments, strict=True))


def _layer_arguments(layer: DecoderLayer) -> tuple | None:
    """The kernel's LatentLayer arguments for `layer`, or None where something in it cannot run fused."""
    attn: LatentAttention = layer.attn
    if attn.attend is None:  # no fixed-order form: the per-head weights are not laid out
        return None
    low_rank = attn.mla.q_lora_rank is not None
    linears = [attn.q_a, attn.q_b] if low_rank else [attn.q]
    if not all(isinstance(linear, W4A8Linear) for linear in [*linears, attn.kv_a, attn.o]):
        return None
    mlp = layer.mlp
    if isinstance(mlp, W4A8MoEBlock):
        feedforward = (None, None, mlp.compiled)
    elif isinstance(mlp, MLP) and isinstance(mlp.gate_up, W4A8Linear) and isinstance(mlp.down, W4A8Linear):
        feedforward = (mlp.gate_up.kernel_weight(), mlp.down.kernel_weight(), None)
    else:
        return None
    mla = attn.mla
    query = ((None, attn.q_a.kernel_weight(), attn.q_a_norm.weight.detach(), attn.q_b.kernel_weight())
             if low_rank else (attn.q.kernel_weight(), None, None, None))
    return (layer.attn_norm.weight.detach(), *query, attn.kv_a.kernel_weight(), attn.kv_a_norm.weight.detach(),
            attn.key_weights, attn.key_scales, attn.value_weights, attn.value_scales, attn.o.kernel_weight(),
            layer.mlp_norm.weight.detach(), *feedforward, attn.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim,
            mla.kv_lora_rank, mla.v_head_dim, mla.rope_interleave, attn.scale * math.sqrt(mla.width),
            layer.attn_norm.eps, mla.latent_norm_eps)
