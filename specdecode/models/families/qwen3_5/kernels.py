"""A hybrid trunk (families/qwen3_5/trunk.py) made batch-invariant where this machine allows, as the Llama family's fused
and fixed-order layers are: its full-attention layers run the compiled fixed-order attention (attention.cpp,
each row summing its visible slots in slot order), and its matmuls are row-invariant (w4a8, or oneDNN's packed
float kernels found so by a probe at load). The Gated DeltaNet layers are row-invariant either way (their
sequential form does the same arithmetic for a row whatever else is in its forward, gated_deltanet.py); here
they also get the compiled form of it (delta_rule.cpp), which reads and writes each row's state once.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.packed_linear import rows_invariant
from specdecode.models.families.qwen3_5.trunk import HybridTransformer
from specdecode.models.kernels.fixed_order import attention_unavailable, layer_linears
from specdecode.models.kernels.w4a8_linear import W4A8Linear, load_kernel


def fix_hybrid_layers(model: HybridTransformer) -> str | None:
    """Give every full-attention layer the fixed-order attention where the matmuls are row-invariant here ->
    None when done, else why not (the layers stay on PyTorch's attention)."""
    reason = attention_unavailable(model.device, model.dtype, model.config.head_dim)
    if reason is not None:
        return reason
    linears = _linears(model)
    w4a8 = all(isinstance(linear, W4A8Linear) for linear in linears)
    if not w4a8:
        if len({type(linear) for linear in linears}) > 1:
            return "its linear layers are packed for oneDNN only in part"
        generator = torch.Generator().manual_seed(0)
        probes = {type(layer.mixer): layer for layer in model.layers}.values()
        samples = [linear for layer in probes for linear in layer_linears(layer)] + [model.lm_head]
        if not all(rows_invariant(linear, generator, model.dtype) for linear in samples):
            return "the matmul on this CPU sums in an order that depends on the number of rows"
    kernel = load_kernel()
    for layer in model.layers:
        if layer.kind == "full_attention":
            layer.mixer.attend = kernel.attend
        else:
            layer.mixer.fused_rule = kernel.delta_rule
        if w4a8:  # the kernels take float32 rows: a float32 residual stream saves two conversions per matmul
            layer.activation_dtype = layer.rope_dtype = torch.float32  # (cos/sin: when called before finish_loading)
            for param in layer.parameters():  # the norms', convolution's and decay's few weights, read every step
                if param.is_floating_point():
                    param.data = param.data.float()
    model.lm_head.rows_invariant_checked = True
    return None


def hybrid_batch_invariant(model: HybridTransformer) -> bool:
    """Whether fix_hybrid_layers made the trunk batch-invariant."""
    attention = [layer.mixer for layer in model.layers if layer.kind == "full_attention"]
    routers = model.config.moe is None or model.routers_invariant
    return all(mixer.attend is not None for mixer in attention) and getattr(model.lm_head, "rows_invariant_checked",
                                                                          False) and routers


def _linears(model: HybridTransformer) -> list[nn.Module]:
    return [linear for layer in model.layers for linear in layer_linears(layer)] + [model.lm_head]
