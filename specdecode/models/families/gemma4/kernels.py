"""A Gemma 4 trunk (families/gemma4/trunk.py) made batch-invariant where this machine allows, as the Llama family's fused
and fixed-order layers and the hybrid trunk's are: every attention layer runs the compiled fixed-order attention
(attention.cpp, each row summing its visible slots in slot order) over its cache slot, and the matmuls are
row-invariant (w4a8, or oneDNN's packed float kernels found so by a probe at load). The per-layer embeddings,
norms and soft cap work row by row anyway. With experts, they run from PyTorch (w4a8 or float, probed as the other
matmuls; the compiled SwiGLU block, kernels/w4a8_moe.py, does not compute Gemma's GeGLU experts), and each
router's logits on oneDNN's packed kernel, probed when the trunk finishes loading (decoder/moe.pack_routers).
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.packed_linear import rows_invariant
from specdecode.models.families.gemma4.trunk import GemmaTransformer
from specdecode.models.kernels.fixed_order import attention_unavailable, layer_linears
from specdecode.models.kernels.w4a8_linear import W4A8Linear, load_kernel


def fix_gemma_layers(model: GemmaTransformer) -> str | None:
    """Give every attention layer the fixed-order attention where the matmuls are row-invariant here -> None when
    done, else why not (the layers stay on PyTorch's attention)."""
    reason = attention_unavailable(model.device, model.dtype, model.cache_shape[1])
    if reason is not None:
        return reason
    # w4a8's kernel is row-invariant by construction; any other kind (float, packed for oneDNN, int8 where a
    # small layer does not fit w4a8's tiles) is probed, one of each kind and shape class per layer.
    linears = [linear for linear in _linears(model) if not isinstance(linear, W4A8Linear)]
    if linears:
        generator = torch.Generator().manual_seed(0)
        samples = list({(type(linear), linear.in_features, linear.out_features): linear for linear in linears}.values())
        if not all(rows_invariant(linear, generator, model.dtype) for linear in samples):
            return "the matmul on this CPU sums in an order that depends on the number of rows"
    attend = load_kernel().attend
    for layer in model.layers:
        layer.attn.attend = attend
    if not linears:  # every matmul w4a8: the kernels take float32 rows, so the residual stream stays float32
        model.activation_dtype = torch.float32  # (the rope tables follow when finish_loading builds them)
        for module in [*model.layers, model.norm, *([model.per_layer_norm] if model.config.family_parts.per_layer_size
                                                    else [])]:
            for param in module.parameters():
                if param.is_floating_point() and param.dim() <= 1:  # norms and layer scalars, read every step
                    param.data = param.data.float()
    model.lm_head.rows_invariant_checked = True
    return None


def gemma_batch_invariant(model: GemmaTransformer) -> bool:
    """Whether fix_gemma_layers made the trunk batch-invariant (with experts, its routers' kernel too)."""
    return all(layer.attn.attend is not None for layer in model.layers) and getattr(
        model.lm_head, "rows_invariant_checked", False) and (model.config.moe is None or model.routers_invariant)


def _linears(model: GemmaTransformer) -> list[nn.Module]:
    extra = [model.per_layer_projection] if model.config.family_parts.per_layer_size else []
    return [linear for layer in model.layers for linear in layer_linears(layer)] + extra + [model.lm_head]
