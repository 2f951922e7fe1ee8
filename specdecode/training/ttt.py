"""The training-time test: a drafter unrolled over its own outputs, every position at once, for every drafter
kind that drafts step by step from hidden states (EAGLE-3 heads, MTP modules); each kind adapts its layer to
`UnrollLayer` (training/eagle3.py, training/mtp.py).

Rows j = 0..N-1 of a sequence stand for positions j (N = T-1: the last token has no next token to pair with).
Step 0 reads the target's features of row j with the embedding of token j+1, as inference reads committed
positions. Step k >= 1 reads the drafter's own step-(k-1) output at row j-1 instead, as draft step k+1 at
position j reads the draft before it. Attention follows inference: the step-k query at row j sees step-0 keys of
rows <= j-k (the committed context of that draft) and step-m keys of row j-k+m for 1 <= m <= k (the drafts
before it, its own included), of the steps run by the same module (an MTP model's later modules see only their
own rows of the draft). Every step's row j predicts token j+2 (the target's distribution at position j+1).
(The EAGLE reference, SafeAILab/EAGLE eagle/traineagle3/cnets.py, unrolls 7 steps the same way with per-step
K/V lists.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from specdecode.models.decoder.layers import Attention
from specdecode.models.decoder.rope import RopeTable, apply_rope

STEP_WEIGHT = 0.8  # step k's loss weighs 0.8^k, as the reference


@dataclass
class UnrollResult:
    """One sequence's loss as terms, each a sum over rows and the weight it is averaged by, so that a batch of
    sequences, split over ranks or not, averages each term over all its rows at once (training/loop.py)."""

    loss_sums: torch.Tensor  # [n_terms] each term's weighted sum over rows (a draft step's, a block slot's ...)
    loss_weights: torch.Tensor  # [n_terms] the weight each sum is averaged by (rows counted), no gradient
    correct: list[int]  # per step: rows whose argmax is the target's own next token
    counted: list[int]  # per step: rows counted (those in the loss mask, in the draft vocabulary or not)
    logits: list[torch.Tensor]  # per step [N, Vd] when asked for (tests compare them with inference)

    @property
    def loss(self) -> torch.Tensor:
        """The sequence's own loss (scalar): each term averaged over its rows, the terms added."""
        return average_terms(self.loss_sums, self.loss_weights)


def average_terms(sums: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sums, weights [n_terms] -> the scalar loss; a term with no weight has a zero sum and adds nothing."""
    return (sums / weights.clamp_min(1e-6)).sum()


class UnrollLayer(Protocol):
    """A drafter's layer as the unroll runs it; `step` says which draft step (a kind may use a module per step)."""

    rope: RopeTable
    device: torch.device
    dtype: torch.dtype

    def first_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features of rows 0..N-1 [N, F] -> the hidden state step 0 reads [N, H]."""

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N] -> [N, H] (the target's embedding, frozen)."""

    def module_of(self, step: int) -> int:
        """Which of the kind's modules runs draft step `step` (0 when there is one)."""

    def attention_inputs(self, step: int, hidden: torch.Tensor, embeds: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, embeds [N, H] -> (the attention's input [N, D_in], the residual added to its output [N, H])."""

    def attention(self, step: int) -> Attention:
        """The attention whose qkv, norms and o the unroll applies."""

    def finish(self, step: int, after_attention: torch.Tensor) -> torch.Tensor:
        """[N, H] -> the layer's output [N, H] (the MLP and its residual)."""

    def logits(self, step: int, out: torch.Tensor) -> torch.Tensor:
        """[N, H] -> draft-vocabulary logits [N, Vd] float32."""

    def feed_back(self, step: int, out: torch.Tensor) -> torch.Tensor:
        """[N, H] -> what the next step reads as its hidden state [N, H]."""


def step_mask(rows: int, step: int, device: torch.device, modules: list[int] | None = None) -> torch.Tensor:
    """[N, (step+1)*N] bool: which keys of steps 0..step the step-`step` query of each row sees; `modules`: the
    module of each step 0..step (keys of another module's steps are not in this module's cache)."""
    j = torch.arange(rows, device=device).view(rows, 1)
    i = torch.arange(rows, device=device).view(1, rows)
    blocks = [i <= j - step] + [i == j - step + m for m in range(1, step + 1)]
    if modules is not None:
        blocks = [block & (modules[s] == modules[step]) for s, block in enumerate(blocks)]
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


def unroll(layer: UnrollLayer, tokens: torch.Tensor, features: torch.Tensor, top_ids: torch.Tensor,
           top_logprobs: torch.Tensor, loss_mask: torch.Tensor, target_to_draft: torch.Tensor,
           steps: int, keep_logits: bool = False) -> UnrollResult:
    """tokens [T]; features [T, F]; top_ids, top_logprobs [T, K]; loss_mask [T] -> the loss, a term per step."""
    rows = tokens.numel() - 1
    device = layer.device
    first = layer.first_hidden(features[:rows].to(layer.dtype))  # [N, H]
    embeds = layer.embed(tokens[1:])  # [N, H]: token j+1 at row j
    draft_ids, weights, usable = soft_targets(top_ids[1:], top_logprobs[1:], target_to_draft)
    wanted = loss_mask[1:]  # [N]: row j's next token (position j+1's) is one to draft
    learn = wanted & usable  # [N]: and the draft vocabulary holds it, so there is something to learn
    positions = torch.arange(rows, device=device).view(1, rows)
    cos, sin = layer.rope.lookup(positions)  # [1, 1, N, D/2]
    modules = [layer.module_of(step) for step in range(steps)]
    keys, values = [], []
    hidden, fed_back = first, first  # fed_back: what the previous step hands the next, [N, H]
    term_sums, term_weights = [], []  # per step: the weighted loss summed over valid rows, and their count
    correct, counted, kept = [], [], []
    for step in range(steps):
        if step:  # row j reads the previous step's output of row j-1 (row 0 has none: masked below)
            hidden = torch.cat([fed_back.new_zeros(1, fed_back.shape[1]), fed_back[:-1]])  # [N, H]
        attn_in, residual = layer.attention_inputs(step, hidden, embeds)  # [N, D_in], [N, H]
        attention = layer.attention(step)
        heads, kv_heads, dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        q, k, v = attention.qkv(attn_in).split(  # [N, h*D], [N, hkv*D], [N, hkv*D]
            [heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = q.view(rows, heads, dim).transpose(0, 1).unsqueeze(0)  # [1, h, N, D]
        k = k.view(rows, kv_heads, dim).transpose(0, 1).unsqueeze(0)  # [1, hkv, N, D]
        if attention.q_norm is not None:
            q, k = attention.q_norm(q), attention.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys.append(k)
        values.append(v.view(rows, kv_heads, dim).transpose(0, 1).unsqueeze(0))
        group = heads // kv_heads
        all_keys = torch.cat(keys, dim=2).repeat_interleave(group, dim=1)  # [1, h, (step+1)N, D]
        all_values = torch.cat(values, dim=2).repeat_interleave(group, dim=1)  # [1, h, (step+1)N, D]
        mask = step_mask(rows, step, device, modules[: step + 1])  # [N, (step+1)N]
        attn = F.scaled_dot_product_attention(q, all_keys, all_values, attn_mask=mask)  # [1, h, N, D]
        attn = attention.o(attn[0].transpose(0, 1).reshape(rows, heads * dim))  # [N, H]
        out = layer.finish(step, residual + attn)  # [N, H]
        logits = layer.logits(step, out)  # [N, Vd]
        log_q = torch.log_softmax(logits, dim=-1)  # [N, Vd]
        if keep_logits:
            kept.append(logits.detach())
        deep_enough = torch.arange(rows, device=device) >= step  # [N]: earlier rows have no drafts this deep
        valid = learn & deep_enough  # [N]
        per_row = -(weights * log_q.gather(1, draft_ids)).sum(-1)  # [N]
        term_sums.append(STEP_WEIGHT**step * (per_row * valid).sum())
        term_weights.append(valid.sum().float())
        # Acceptance counts every wanted row: a next token outside the draft vocabulary is a certain miss.
        hits = (log_q.argmax(-1) == draft_ids[:, 0]) & valid  # [N]
        correct.append(int(hits.sum()))
        counted.append(int((wanted & deep_enough).sum()))
        fed_back = layer.feed_back(step, out)
    return UnrollResult(torch.stack(term_sums), torch.stack(term_weights), correct, counted, kept)
