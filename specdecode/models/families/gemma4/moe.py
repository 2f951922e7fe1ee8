"""Gemma 4's mixture of experts (26B-A4B: `enable_moe_block`), as transformers' Gemma4TextRouter and
Gemma4TextExperts compute it, on the shared block (decoder/moe.py: each chosen expert run once over its rows, a
row's k products summed in float32 in its slot order, as transformers' grouped experts sum them).

Every layer has it beside the dense MLP (layers.py adds the two). What differs from the shared block:
- the router reads the residual stream itself: its rows normed without a weight, times a learned scale per
  feature and 1/sqrt(hidden), then a softmax in float32 over the logits, the best k renormalised to sum to 1
  and each then times its expert's learned scale;
- the experts read the stream through a norm of their own (pre_feedforward_layernorm_2), and their sum passes
  another (post_feedforward_layernorm_2);
- the experts are GeGLU with the tanh GELU (MoEConfig.activation).
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.moe import MoEBlock, Router
from specdecode.models.families.gemma4.norm import GemmaRMSNorm
from specdecode.models.model_config import ModelConfig


class GemmaRouter(Router):
    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, with_weight=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))  # [H] router.scale
        self.per_expert_scale = nn.Parameter(torch.ones(config.moe.num_experts))  # [E] router.per_expert_scale
        self.root_size = config.hidden_size ** -0.5

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> [N, E] in the router weight's dtype. Where the residual stream is float32 for w4a8
        (kernels.py) the scaled rows are rounded to the weight's dtype, which the packed kernel takes."""
        scaled = self.norm(x) * self.scale * self.root_size  # [N, H] in transformers' order of products
        return super().logits(scaled.to(self.weight.dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = self.choose(self.logits(x))  # [N, k] float32 each, renormalised
        # After the renormalisation, and kept in float32 as transformers keeps them.
        return weights * self.per_expert_scale[experts], experts


class GemmaMoEBlock(MoEBlock):
    """x [B, T, H], the residual stream after attention -> the experts' part of the layer's feed-forward output."""

    router_class = GemmaRouter

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.norm_in = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # pre_feedforward_layernorm_2
        self.norm_out = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # post_feedforward_layernorm_2

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        rows = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, experts = self.router(rows)  # [N, k] each
        routed = self.routed(self.norm_in(rows), weights, experts).to(x.dtype)  # [N, H]
        return self.norm_out(routed.view_as(x))
