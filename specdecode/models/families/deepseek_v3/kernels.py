"""The batch-invariant form of a latent-attention trunk: every latent attention (the trunk's and its MTP modules')
in its fixed-order form (decoder/mla.py: the compiled attention, the per-head products on row-invariant matmuls),
where this machine runs the kernel and every matmul proves row-invariant; the norms, the experts and the routers
work row by row (the routers packed at load, decoder/moe.py)."""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.layers import MLP
from specdecode.models.decoder.mla import LatentAttention
from specdecode.models.decoder.packed_linear import PackedLinear, can_pack, rows_invariant
from specdecode.models.families.deepseek_v3.trunk import LatentTransformer, attentions
from specdecode.models.kernels.fixed_order import attention_unavailable
from specdecode.models.kernels.w4a8_linear import load_kernel


def fix_latent_layers(model: LatentTransformer) -> str | None:
    """Put every latent attention in its fixed-order form where that makes the model batch-invariant here
    -> None when done, else why not (the PyTorch forms stay)."""
    reason = attention_unavailable(model.device, model.dtype, model.config.mla.width)
    if reason is not None:
        return reason
    first = model.layers[0]
    attn: LatentAttention = first.attn
    mlp = next(module for module in first.mlp.modules() if isinstance(module, MLP))  # a mixture's first expert
    query = [attn.q] if model.config.mla.q_lora_rank is None else [attn.q_a, attn.q_b]
    probes = [*query, attn.kv_a, attn.o, mlp.gate_up, mlp.down, model.lm_head]
    # oneDNN's packed kernels where this CPU has them; else PyTorch's own, which the probe must find invariant too.
    wrap = PackedLinear if can_pack(model) else nn.Identity()
    w_uk, _ = attn.up_weights()  # [nh, nope, C]
    plain = nn.Linear(w_uk.shape[1], w_uk.shape[2], bias=False, dtype=model.dtype)
    plain.weight = nn.Parameter(w_uk[0].T.detach().contiguous(), requires_grad=False)
    generator = torch.Generator().manual_seed(0)
    if not all(rows_invariant(linear, generator, model.dtype) for linear in [*probes, wrap(plain)]):
        return "the matmul on this CPU sums in an order that depends on the number of rows"
    attend = load_kernel().attend
    for latent in attentions(model):
        latent.fix(attend, wrap)
    model.lm_head.rows_invariant_checked = True  # see batch_invariance.py
    return None


def latent_batch_invariant(model: LatentTransformer) -> bool:
    return (all(attn.attend is not None for attn in attentions(model)) and model.routers_invariant
            and getattr(model.lm_head, "rows_invariant_checked", False))
