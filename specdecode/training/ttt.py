"""EAGLE-3's training-time test: the head unrolled over its own outputs, every position at once.

Rows j = 0..N-1 of a sequence stand for positions j (N = T-1: the last token has no next token to pair with).
Step 0 reads the fused target features g_j with the embedding of token j+1, as inference reads committed
positions. Step k >= 1 reads the head's own step-(k-1) output at row j-1 instead, as draft step k+1 at position
j reads the draft before it. Attention follows inference: the step-k query at row j sees step-0 keys of rows
<= j-k (the committed context of that draft) and step-m keys of row j-k+m for 1 <= m <= k (the drafts before
it, its own included). Every step's row j predicts token j+2 (the target's distribution at position j+1).
(The EAGLE reference, SafeAILab/EAGLE eagle/traineagle3/cnets.py, unrolls 7 steps the same way with per-step
K/V lists.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdecode.models.eagle3_head import Eagle3Head
from specdecode.models.rope import apply_rope

STEP_WEIGHT = 0.8  # step k's loss weighs 0.8^k, as the reference


@dataclass
class UnrollResult:
    loss: torch.Tensor  # scalar, weighted over steps
    correct: list[int]  # per step: rows whose argmax is the target's own next token
    counted: list[int]  # per step: rows counted (those in the loss mask, in the draft vocabulary or not)
    logits: list[torch.Tensor]  # per step [N, Vd] when asked for (tests compare them with inference)


def step_mask(rows: int, step: int, device: torch.device) -> torch.Tensor:
    """[N, (step+1)*N] bool: which keys of steps 0..step the step-`step` query of each row sees."""
    j = torch.arange(rows, device=device).view(rows, 1)
    i = torch.arange(rows, device=device).view(1, rows)
    blocks = [i <= j - step] + [i == j - step + m for m in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def soft_targets(top_ids: torch.Tensor, top_logprobs: torch.Tensor, target_to_draft: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's top-K next-token law restricted to the draft vocabulary and renormalised.

    top_ids, top_logprobs [N, K]; target_to_draft [V] long (-1 outside). -> (draft ids [N, K] (0 where
    outside), weights [N, K], usable [N] bool: the target's own next token is in the draft vocabulary, as the
    reference masks its loss)."""
    draft_ids = target_to_draft[top_ids]  # [N, K]
    inside = draft_ids >= 0
    weights = top_logprobs.exp() * inside
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-12)
    return draft_ids.clamp_min(0), weights, inside[:, 0]


def unroll(head: Eagle3Head, tokens: torch.Tensor, features: torch.Tensor, top_ids: torch.Tensor,
           top_logprobs: torch.Tensor, loss_mask: torch.Tensor, target_to_draft: torch.Tensor,
           steps: int, keep_logits: bool = False) -> UnrollResult:
    """tokens [T]; features [T, n_aux*Ht]; top_ids, top_logprobs [T, K]; loss_mask [T] -> the weighted loss."""
    layer, config = head.layer, head.config.layer
    rows = tokens.numel() - 1
    device = head.device
    states = list(features[:rows].to(head.dtype).split(head.config.target_hidden_size, dim=-1))
    fused = head.fuse(states)  # [N, H]
    embeds = head.embed_tokens(tokens[1:].view(1, rows))[0]  # [N, H]: token j+1 at row j
    draft_ids, weights, usable = soft_targets(top_ids[1:], top_logprobs[1:], target_to_draft)
    wanted = loss_mask[1:]  # [N]: row j's next token (position j+1's) is one to draft
    learn = wanted & usable  # [N]: and the draft vocabulary holds it, so there is something to learn
    positions = torch.arange(rows, device=device).view(1, rows)
    cos, sin = head.rope.lookup(positions)  # [1, 1, N, D/2]
    heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
    keys, values = [], []
    hidden, fed_back = fused, fused  # fed_back: what the previous step hands the next, [N, H]
    loss = fused.new_zeros(())
    correct, counted, kept = [], [], []
    for step in range(steps):
        if step:  # row j reads the previous step's output of row j-1 (row 0 has none: masked below)
            hidden = torch.cat([fed_back.new_zeros(1, fed_back.shape[1]), fed_back[:-1]])  # [N, H]
        normed = layer.hidden_norm(hidden)  # [N, H]
        attn_in = torch.cat([layer.input_norm(embeds), normed], dim=-1)  # [N, 2H]
        q, k, v = layer.attn.qkv(attn_in).split(  # [N, h*D], [N, hkv*D], [N, hkv*D]
            [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = apply_rope(q.view(rows, heads, dim).transpose(0, 1).unsqueeze(0), cos, sin)  # [1, h, N, D]
        k = apply_rope(k.view(rows, kv_heads, dim).transpose(0, 1).unsqueeze(0), cos, sin)  # [1, hkv, N, D]
        keys.append(k)
        values.append(v.view(rows, kv_heads, dim).transpose(0, 1).unsqueeze(0))
        group = heads // kv_heads
        all_keys = torch.cat(keys, dim=2).repeat_interleave(group, dim=1)  # [1, h, (step+1)N, D]
        all_values = torch.cat(values, dim=2).repeat_interleave(group, dim=1)  # [1, h, (step+1)N, D]
        mask = step_mask(rows, step, device)  # [N, (step+1)N]
        attn = F.scaled_dot_product_attention(q, all_keys, all_values, attn_mask=mask)  # [1, h, N, D]
        attn = layer.attn.o(attn[0].transpose(0, 1).reshape(rows, heads * dim))  # [N, H]
        residual = normed if layer.norm_before_residual else hidden
        after_attn = residual + attn  # [N, H]
        out = after_attn + layer.mlp(layer.mlp_norm(after_attn))  # [N, H]
        logits = head.lm_head(head.norm(out)).float()  # [N, Vd]
        log_q = torch.log_softmax(logits, dim=-1)  # [N, Vd]
        if keep_logits:
            kept.append(logits.detach())
        deep_enough = torch.arange(rows, device=device) >= step  # [N]: earlier rows have no drafts this deep
        valid = learn & deep_enough  # [N]
        per_row = -(weights * log_q.gather(1, draft_ids)).sum(-1)  # [N]
        loss = loss + STEP_WEIGHT**step * (per_row * valid).sum() / valid.sum().clamp_min(1)
        # Acceptance counts every wanted row: a next token outside the draft vocabulary is a certain miss.
        hits = (log_q.argmax(-1) == draft_ids[:, 0]) & valid  # [N]
        correct.append(int(hits.sum()))
        counted.append(int((wanted & deep_enough).sum()))
        fed_back = head.norm(out) if head.config.norm_output else out
    return UnrollResult(loss, correct, counted, kept)
