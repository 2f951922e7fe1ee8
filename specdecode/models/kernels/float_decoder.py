"""bfloat16 and float32 decoder layers that are batch-invariant, as the fused w4a8 ones are.

With the PyTorch layers, a float target's logits for a token differ in their last bits between decoding it alone
and verifying it among drafted tokens, in a tree or in a batch: the matmul and attention kernels pick their
reduction order by the number of rows. Where the top two logits are that close, speculative output then differs
from plain decoding (on MT-bench in bf16, on 56-69% of conversations). These layers remove both causes:

- the matmuls run through oneDNN's packed kernels (packed_linear.py), which sum in an order independent of the
  number of rows from two rows up, and a single row runs as two; where oneDNN has no bf16 kernel (x86 CPUs
  without AVX-512), bf16 weights stay unpacked and PyTorch's own bf16 matmul, one dot product per output, runs
  them (row-invariant too, but compute-bound: 8 rows cost about 6x one);
- attention runs in C++ (attention.cpp, shared with the w4a8 layers), each row summing its visible slots in
  ascending slot order, in float32 over the model-dtype cache.

Norms, rotary embeddings and SiLU stay PyTorch element-wise or row-wise ops (the same per row whatever the number
of rows). So greedy speculative output is bitwise plain decoding in bf16 and fp32 too (tested, on the default
pair as well). Layers are replaced only where all of this holds on this machine: a CPU model in bf16 or fp32, a
compiler for the kernel, every linear found row-invariant by a probe at load.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.layers import MLP, Attention, DecoderLayer
from specdecode.models.decoder.packed_linear import PackedLinear, rows_invariant
from specdecode.models.decoder.rope import apply_rope
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.kernels.w4a8_linear import load_kernel, w4a8_unavailable

_DTYPES = (torch.float32, torch.bfloat16)  # what the C++ attention reads and writes


class FloatDecoderLayer(DecoderLayer):
    """A float decoder layer with fixed-order attention; the same submodules as the layer it replaces, so saved
    weights keep their names."""

    def __init__(self, layer: DecoderLayer, attend):
        nn.Module.__init__(self)
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = layer.attn_norm, layer.attn, layer.mlp_norm, layer.mlp
        self.attend = attend  # the compiled attention (attention.h's `attend`)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | CacheBatch,
                index: int, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + fixed_order_attention(self.attn, self.attend, self.attn_norm(x), cos, sin, cache, index, mask)
        return x + self.mlp(self.mlp_norm(x))


def fixed_order_attention(attn: Attention, attend, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          cache: KVCache | CacheBatch, index: int, mask: torch.Tensor | None) -> torch.Tensor:
    """What `attn` computes (its projections, norms and rope; x [B, T, in] -> [B, T, hidden]), with the attention
    itself in the compiled fixed-order kernel (`attend`), which reads each sequence's cache in place."""
    batch, new, _ = x.shape
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q, k, v = attn.qkv(x).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = q.view(batch, new, heads, dim)  # [B, T, H, D]
    k = k.view(batch, new, kv_heads, dim)  # [B, T, Hkv, D]
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # [B, T, 1, D/2]: rope over heads in dim 2
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    qkv = torch.cat([q.flatten(2), k.flatten(2), v], dim=-1).float()  # [B, T, (H + 2 Hkv) * D]
    keys, values = cache.layer_views(index)  # one [Hkv, S, D] tensor each per sequence
    attended = attend(qkv, keys, values, cache.lengths, mask, heads, kv_heads, dim)  # [B, T, H*D] float32
    return attn.o(attended.to(x.dtype))


def fix_float_layers(model: Transformer) -> str | None:
    """Replace a float model's decoder layers by FloatDecoderLayer where that makes it batch-invariant here.
    -> None when replaced, else why not (the PyTorch layers stay)."""
    if model.device.type != "cpu" or model.dtype not in _DTYPES:
        return f"the fixed-order layers run on the CPU in bfloat16 or float32, not {model.device.type} {model.dtype}"
    if model.config.head_dim % 16:
        return f"the fixed-order attention needs a head size that is a multiple of 16, not {model.config.head_dim}"
    linears = [module for layer in model.layers for module in layer.modules()
               if isinstance(module, (nn.Linear, PackedLinear))] + [model.lm_head]
    if len({type(linear) for linear in linears}) > 1:
        return "its linear layers are packed for oneDNN only in part"
    reason = w4a8_unavailable()
    if reason is not None:
        return f"the attention kernel is unavailable: {reason}"
    # Packed (oneDNN) where the CPU has its kernels; else bf16 weights stay nn.Linear, which PyTorch multiplies
    # with its own bf16 kernel on CPUs without AVX-512 (one dot product per output, in an order of its own).
    # Either way the probe decides.
    generator = torch.Generator().manual_seed(0)
    first = model.layers[0]
    mlp = next(module for module in first.mlp.modules() if isinstance(module, MLP))  # a mixture's first expert
    probes = (first.attn.qkv, first.attn.o, mlp.gate_up, mlp.down, model.lm_head)
    if not all(rows_invariant(linear, generator, model.dtype) for linear in probes):
        return "the matmul on this CPU sums in an order that depends on the number of rows"
    attend = load_kernel().attend
    model.layers = nn.ModuleList(FloatDecoderLayer(layer, attend) for layer in model.layers)
    model.lm_head.rows_invariant_checked = True  # see batch_invariance.py
    return None


def float_batch_invariant(model: Transformer) -> bool:
    """Every layer a fixed-order float layer (installed only with row-invariant linears) and the output head the
    one fix_float_layers probed."""
    return (all(isinstance(layer, FloatDecoderLayer) for layer in model.layers)
            and getattr(model.lm_head, "rows_invariant_checked", False))
