"""Multi-token-prediction (MTP) modules that ship inside a model (DeepSeek-V3 2024, GLM-4.5, MiMo-7B).

Module j at position i combines a hidden state of token i with the embedding of the token after it and
predicts one token further, through the model's own output head. As vLLM and SGLang compute it:

    u      = proj(concat(token_norm(embed(x_{i+1})), hidden_norm(h_i)))   DeepSeek / GLM order: embedding first
           = proj(concat(hidden_norm(h_i), token_norm(embed(x_{i+1}))))   MiMo order: hidden first
    y      = block(u)                                                      a decoder layer of the trunk's family
    logits = lm_head(out_norm(y))                                          the trunk's head (DeepSeek's copy)

The first module reads the trunk's final hidden state after its final norm (what feeds lm_head). A further
draft step feeds back y, before out_norm, as vLLM does for DeepSeek; MiMo's own code defines one step only, so
ours follows the same rule for both and a GGUF file (DeepSeek names) means the same thing as a MiMo folder.
Qwen 3.5 (3.6) ships one module, reused for every draft step, which feeds back out_norm(y) (vLLM's
qwen3_5_mtp.py and transformers' MtpLayer with its post_norm agree), with zero-centred norms, its block a gated
full-attention layer of the trunk's family, in the [embedding ; hidden] order:
    qwen3_5:  mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm, layers.{j}.<decoder layer>}

Names in checkpoints (each family's tensor maps, families/, put them onto ours, `mtp.{j}.*`):
    deepseek: model.layers.{L+j}.{enorm, hnorm, eh_proj, shared_head.norm, <decoder layer>}
    mimo:     model.mtp_layers.{j}.{token_layernorm, hidden_layernorm, input_proj, final_layernorm, <decoder layer>}
    GGUF:     blk.{L+j}.nextn.{enorm, hnorm, eh_proj, shared_head_norm} and blk.{L+j}.<decoder layer>
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.kv_cache import KVCache
from specdecode.models.decoder.layers import norm_class
from specdecode.models.model_config import ModelConfig


class MTPModule(nn.Module):
    def __init__(self, config: ModelConfig, block: nn.Module, feeds_back_normed: bool = False):
        """`block`: a decoder layer of the trunk's family (Transformer.build_mtp_block), with a KV cache of its own
        (index 0), Qwen 3.5's a full-attention layer of its hybrid trunk; `feeds_back_normed`: a further step is fed
        out_norm(y) (Qwen 3.5: vLLM's qwen3_5_mtp, transformers' MtpLayer post_norm), else y."""
        super().__init__()
        hidden = config.hidden_size
        norm = norm_class(config)
        self.token_norm = norm(hidden, config.rms_norm_eps)  # on the next token's embedding
        self.hidden_norm = norm(hidden, config.rms_norm_eps)  # on the incoming hidden state
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.out_norm = norm(hidden, config.rms_norm_eps)
        self.hidden_first = config.mtp_layout == "mimo"
        self.feeds_back_normed = feeds_back_normed

    @classmethod
    def sharing(cls, module: MTPModule, block: nn.Module) -> MTPModule:
        """`module`'s weights with another block over the same submodules (batch_invariance.py's fixed-order
        attention); the original is left as it was."""
        twin = cls.__new__(cls)
        nn.Module.__init__(twin)
        twin.token_norm, twin.hidden_norm, twin.proj = module.token_norm, module.hidden_norm, module.proj
        twin.block, twin.out_norm, twin.hidden_first = block, module.out_norm, module.hidden_first
        twin.feeds_back_normed = module.feeds_back_normed
        return twin

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden [B, T, H]; cos, sin [B, 1, T, D/2]; mask [B, 1, T, S] or None
        -> (out_norm(y), the lm_head input [B, T, H]; y, what a further step feeds back [B, T, H])."""
        parts = [self.token_norm(embeds), self.hidden_norm(hidden)]
        joined = torch.cat(parts[::-1] if self.hidden_first else parts, dim=-1)  # [B, T, 2H]
        # One cache per module (index 0): a module's rows are its own, whatever the others hold.
        out = self.block(self.proj(joined), cos, sin, cache, 0, mask)  # [B, T, H]
        normed = self.out_norm(out)
        return normed, normed if self.feeds_back_normed else out
