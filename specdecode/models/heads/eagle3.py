"""The EAGLE-3 draft head (Li et al. 2025): one decoder layer that reads the target's hidden states.

Per position i it takes the fused target features of token i (three residual-stream states at the boundary
ids of its config, by default 2, L//2 and L-3) and the embedding of token i+1, and predicts token i+2 over a
reduced draft vocabulary; later draft steps feed back the head's own output hidden state instead of the fused
features. The forward, as the EAGLE reference (SafeAILab/EAGLE eagle/model/cnets.py), vLLM and SGLang compute it:

    g   = fc(concat(h_a, h_b, h_c))                      first step only; n_aux*Ht -> H
    u   = concat(input_layernorm(embed(x)), hidden_norm(g))   width 2H, embedding first
    a   = g + attn(u)                                    residual = hidden_norm(g) with norm_before_residual
    out = a + mlp(post_attention_layernorm(a))           fed back to the next draft step (pre-norm)
    logits = lm_head(norm(out))                          [Vd]; target id = draft id + d2t[draft id]

Our module names (`layer.attn.qkv`, ...) differ from the published ones; formats/eagle3.py maps them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from specdecode.models.decoder.kv_cache import CacheBatch, KVCache
from specdecode.models.decoder.layers import MLP, Attention, RMSNorm
from specdecode.models.decoder.rope import RopeTable, inverse_frequencies
from specdecode.models.decoder.transformer import attention_mask, pick_rows
from specdecode.models.model_config import ModelConfig


@dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the decoder layer's sizes, rope and biases (num_layers 1; vocab_size = the target's)
    target_hidden_size: int  # Ht, the width of each fused target state
    draft_vocab_size: int  # Vd, rows of lm_head
    layer_ids: tuple[int, ...]  # target boundary ids read, ascending (the fc's column blocks follow them)
    norm_before_residual: bool = False  # the attention's residual is hidden_norm(g), not g
    norm_output: bool = False  # later steps feed back norm(out) instead of out ("EAGLE 3.1")
    norm_before_fc: bool = False  # one RMSNorm over the concatenated features before fc
    fc_norm: bool = False  # an RMSNorm per fused state before fc
    own_embedding: bool = False  # the checkpoint carries embed_tokens (else the target's is used)
    own_head: bool = True  # the checkpoint carries lm_head (else the target's, over the full vocabulary)
    logit_scale: float = 1.0

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def fused_size(self) -> int:
        return self.target_hidden_size * len(self.layer_ids)


class Eagle3Layer(nn.Module):
    """The decoder layer: attention over [embedding; hidden] (2H wide in), a plain MLP."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        layer, hidden = config.layer, config.hidden_size
        self.input_norm = RMSNorm(hidden, layer.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(hidden, layer.rms_norm_eps)  # on the incoming hidden state
        self.attn = Attention(layer)
        qkv_out = (layer.num_heads + 2 * layer.num_kv_heads) * layer.head_dim
        self.attn.qkv = nn.Linear(2 * hidden, qkv_out, bias=layer.qkv_bias)  # the 2H-wide input
        self.mlp_norm = RMSNorm(hidden, layer.rms_norm_eps)
        self.mlp = MLP(layer)
        self.norm_before_residual = config.norm_before_residual
        # The attention as Attention's forward takes it; batch_invariance.fix_eagle3_attention puts the fixed-order
        # kernel's here where that makes the head batch-invariant. None: the PyTorch attention, self.attn.
        self.fixed_attention: Callable[..., torch.Tensor] | None = None

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache, mask: torch.Tensor | None) -> torch.Tensor:
        """embeds, hidden [B, T, H]; cos, sin [B, 1, T, D/2]; mask [B, 1, T, S] or None -> out [B, T, H]."""
        normed_hidden = self.hidden_norm(hidden)
        attn_in = torch.cat([self.input_norm(embeds), normed_hidden], dim=-1)  # [B, T, 2H], embedding first
        residual = normed_hidden if self.norm_before_residual else hidden
        attention = self.attn if self.fixed_attention is None else self.fixed_attention
        x = residual + attention(attn_in, cos, sin, cache, 0, mask)  # [B, T, H]
        return x + self.mlp(self.mlp_norm(x))


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, target_embed: nn.Embedding, target_head: nn.Module | None = None):
        super().__init__()
        self.config = config
        hidden, fused = config.hidden_size, config.fused_size
        eps = config.layer.rms_norm_eps
        self.fused_norm = RMSNorm(fused, eps) if config.norm_before_fc else None
        self.fc_norms = nn.ModuleList(RMSNorm(config.target_hidden_size, eps) for _ in config.layer_ids) \
            if config.fc_norm else None
        self.fc = nn.Linear(fused, hidden, bias=False)
        self.layer = Eagle3Layer(config)
        self.norm = RMSNorm(hidden, eps)
        self.embed = nn.Embedding(config.layer.vocab_size, hidden) if config.own_embedding else None
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False) if config.own_head else None
        # Shared with the target, not owned: kept out of this module's parameters (and out of its state dict).
        self._shared = {"embed": target_embed, "head": target_head}
        # [Vd] long: the target id of each draft id (the checkpoint's d2t offsets plus the draft id).
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)
        self.rope: RopeTable | None = None

    def finish_loading(self, max_positions: int) -> None:
        """Once weights, dtype and device are final: the head's own rope table (its config's theta and scaling)."""
        self.rope = RopeTable(inverse_frequencies(self.config.layer), max_positions, self.dtype, self.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # a norm's: the linear layers may be quantized (no float .weight)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def output_head(self) -> nn.Module:
        """Its own output layer, or the target's it shares."""
        return self.lm_head if self.lm_head is not None else self._shared["head"]

    def new_cache(self, capacity: int) -> KVCache:
        layer = self.config.layer
        return KVCache(1, 1, layer.num_kv_heads, layer.head_dim, capacity, self.dtype, self.device)

    def fuse(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The target's states [T, Ht] each, in layer_ids order -> g [T, H]."""
        if self.fc_norms is not None:
            states = [norm(state) for norm, state in zip(self.fc_norms, states)]
        fused = torch.cat(states, dim=-1).to(self.dtype)  # [T, n_aux*Ht]
        if self.fused_norm is not None:
            fused = self.fused_norm(fused)
        return self.fc(fused)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> [B, T, H] in the head's dtype."""
        table = self.embed if self.embed is not None else self._shared["embed"]
        return table(tokens).to(self.dtype)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | CacheBatch, attn_mask: torch.Tensor | None = None,
                logits_at: torch.Tensor | slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T], hidden [B, T, H] (fused features or a previous step's output), positions [B, T];
        cache, attn_mask and logits_at as Transformer.forward's. -> (draft logits [B, T', Vd] float32, the
        hidden to feed back [B, T, H])."""
        new = tokens.shape[1]
        cache.check_room(new)
        mask = attention_mask(positions, cache, attn_mask)
        cos, sin = self.rope.lookup(positions)
        cache.record_positions(positions)
        out = self.layer(self.embed_tokens(tokens), hidden.to(self.dtype), cos, sin, cache, mask)  # [B, T, H]
        cache.advance(new)
        normed = self.norm(out)  # [B, T, H]
        logits = self.output_head(pick_rows(normed, logits_at)).float()  # [B, T', Vd]
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        return logits, (normed if self.config.norm_output else out)
