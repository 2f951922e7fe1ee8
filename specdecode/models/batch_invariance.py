"""Whether a model's forward is batch-invariant: a token's logits bitwise the same however many rows and
sequences share its forward (decoded alone, verified in a chain or a tree, batched with other requests)."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from specdecode.models.decoder.layers import DecoderLayer
from specdecode.models.decoder.mla import LatentAttention
from specdecode.models.decoder.moe import Router
from specdecode.models.decoder.mtp import MTPModule
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.families.registry import family_of
from specdecode.models.heads.dflash import DFlashModel
from specdecode.models.heads.eagle3 import Eagle3Head
from specdecode.models.kernels.fixed_order import layer_linears
from specdecode.models.kernels.float_decoder import FloatDecoderLayer, fixed_order_attention
from specdecode.models.kernels.w4a8_linear import W4A8Linear, load_kernel, w4a8_unavailable


def batch_invariant(model: Transformer) -> bool:
    """Whether the model's family made its layers batch-invariant here (fused w4a8 layers, or fixed-order float
    ones, with an output head that sums the same way whatever its rows)."""
    return family_of(model.config).batch_invariant(model)


def batch_invariant_mtp(modules: nn.ModuleList, head: nn.Module, cache_dtype: torch.dtype) -> nn.ModuleList | None:
    """MTP modules that draft batch-invariantly through `head`: the same modules (weights shared) with each
    block's attention in the fixed-order kernel, where every matmul in them and in the head is w4a8 (the other
    operations work row by row) and the kernel reads their caches' dtype; else None. Their drafts then do not
    depend on what shares their forwards."""
    heads = list(head) if isinstance(head, nn.Sequential) else [head]  # a reduced head is a container of one
    if isinstance(getattr(modules[0].block, "attn", None), LatentAttention):
        # Latent attention took its fixed-order form with the trunk's where the block's matmuls proved row-invariant
        # (families/deepseek_v3/kernels.py); the modules' projections and the head must be w4a8, as below.
        linears = heads + [module.proj for module in modules]
        fixed = all(module.block.attn.attend is not None for module in modules)
        return modules if fixed and all(isinstance(linear, W4A8Linear) for linear in linears) else None
    # A Llama-style block's attention is `attn`, and a fixed-order layer wraps the block; a hybrid trunk's block
    # (Qwen 3.5's) names it `mixer`, which takes the kernel as an attribute.
    llama_style = isinstance(modules[0].block, DecoderLayer)
    attentions = [module.block.attn if llama_style else module.block.mixer for module in modules]
    linears = heads + [linear for module, attn in zip(modules, attentions) for linear in (
        module.proj, attn.qkv, attn.o, *_mlp_matmuls(module.block))]
    if not all(isinstance(linear, W4A8Linear) for linear in linears):
        return None
    if not _kernel_reads(cache_dtype, attentions[0].head_dim):
        return None
    attend = load_kernel().attend
    if not llama_style:
        for attn in attentions:
            attn.attend = attend
        return modules
    return nn.ModuleList(MTPModule.sharing(module, FloatDecoderLayer(module.block, attend)) for module in modules)


def _mlp_matmuls(block: nn.Module) -> list[nn.Module]:
    """A block's MLP matmuls: a dense MLP's two, or a mixture of experts' experts and shared experts (its router
    runs on a row-invariant kernel of its own, decoder/moe.py, checked once for the whole model)."""
    routers = {id(module.packed) for module in block.mlp.modules() if isinstance(module, Router)}
    return [linear for linear in layer_linears(block.mlp) if id(linear) not in routers]


def fix_eagle3_attention(head: Eagle3Head) -> bool:
    """Run an EAGLE-3 head's attention in the fixed-order kernel where that makes its drafting batch-invariant:
    every matmul of its layer and its output head w4a8, the kernel able to read its cache -> whether it now is.
    (fc fuses each request's own target rows at commit, never batched, so its kind does not matter.)"""
    layer = head.layer
    linears = (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down, head.output_head)
    if not all(isinstance(linear, W4A8Linear) for linear in linears):
        return False
    if not _kernel_reads(head.dtype, layer.attn.head_dim):
        return False
    layer.fixed_attention = partial(fixed_order_attention, layer.attn, load_kernel().attend)
    return True


def fix_dflash_attention(model: DFlashModel) -> bool:
    """Give a DFlash (or DSpark) backbone the fixed-order attention where that makes its blocks batch-invariant:
    every matmul of its layers and of the head its drafting slots go through w4a8, the kernel able to read its
    cache -> whether it now has it. (fc fuses each request's own target rows at commit, never batched, and
    DSpark's Markov and confidence heads run per request, so their kinds do not matter.)"""
    layers = [linear for layer in model.layers
              for linear in (layer.q, layer.kv, layer.o, layer.mlp.gate_up, layer.mlp.down)]
    if not all(isinstance(linear, W4A8Linear) for linear in [model.output_head, *layers]):
        return False
    if not _kernel_reads(model.dtype, model.config.layer.head_dim):
        return False
    model.fixed_attend = load_kernel().attend
    return True


def _kernel_reads(cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the fixed-order attention kernel runs here over a cache of this dtype and head size."""
    return cache_dtype in (torch.float32, torch.bfloat16) and head_dim % 16 == 0 and w4a8_unavailable() is None
