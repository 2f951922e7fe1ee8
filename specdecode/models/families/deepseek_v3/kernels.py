"""The batch-invariant form of a latent-attention trunk: every latent attention (the trunk's and its MTP modules')
in its fixed-order form (decoder/mla.py: the compiled attention and per-head products), where this machine runs
the kernel and every matmul proves row-invariant; the norms, the experts and the routers work row by row (the
routers packed at load or run by the compiled block, decoder/moe.py, kernels/w4a8_moe.py)."""

from __future__ import annotations

import torch

from specdecode.models.decoder.layers import MLP
from specdecode.models.decoder.mla import LatentAttention
from specdecode.models.decoder.packed_linear import rows_invariant
from specdecode.models.families.deepseek_v3.trunk import LatentTransformer, attentions
from specdecode.models.kernels.fixed_order import attention_unavailable
from specdecode.models.kernels.w4a8_linear import load_kernel


def fix_latent_layers(model: LatentTransformer, int8_heads: bool = False) -> str | None:
    """Put every latent attention in its fixed-order form where that makes the model batch-invariant here
    -> None when done, else why not (the PyTorch forms stay). `int8_heads`: its per-head weights as int8 codes
    (a quantized model's, decoder/mla.py)."""
    reason = attention_unavailable(model.device, model.dtype, model.config.mla.width)
    if reason is not None:
        return reason
    first = model.layers[0]
    attn: LatentAttention = first.attn
    mlp = next(module for module in first.mlp.modules() if isinstance(module, MLP))  # a mixture's first expert
    query = [attn.q] if model.config.mla.q_lora_rank is None else [attn.q_a, attn.q_b]
    probes = [*query, attn.kv_a, attn.o, mlp.gate_up, mlp.down, model.lm_head]
    generator = torch.Generator().manual_seed(0)
    if not all(rows_invariant(linear, generator, model.dtype) for linear in probes):
        return "the matmul on this CPU sums in an order that depends on the number of rows"
    kernel = load_kernel()
    for latent in attentions(model):
        latent.fix(kernel, int8_heads)
    model.lm_head.rows_invariant_checked = True  # see batch_invariance.py
    return None


def latent_batch_invariant(model: LatentTransformer) -> bool:
    return (all(attn.attend is not None for attn in attentions(model)) and model.routers_invariant
            and getattr(model.lm_head, "rows_invariant_checked", False))
