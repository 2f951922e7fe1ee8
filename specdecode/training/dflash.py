"""Train a DFlash drafter for a target on this machine, in the one training loop (loop.py), from the features
`train eagle3` and `train mtp` share: it reads the same three boundaries as EAGLE-3 (layers 1, L/2 - 1 and L-4
in DFlash's "output of layer k" ids).

The objective, as the public re-implementations train it (DeepSpec, speculators; z-lab has not released its
own): random anchor positions a inside the loss mask, each a block [x_a, MASK x (B-1)] at positions a..a+B-1
that sees the target's context strictly before a and its own block (blocks do not see each other); slot j
learns the target's distribution for the token at a+j (its top-32 soft labels), weighted exp(-(j-1)/4). All of
a sequence's blocks run in one forward. Held-out acceptance per slot counts a slot as accepted when it and
every slot before it name the target's own token, as verification would. The mask token is the embedding's
last row (a padding row in Qwen's vocabularies, never a real token); the drafter drafts over the full
vocabulary through the target's head, whose rows are kept in bf16 for the loss (float32 where bf16 matmuls
are slow: CPUs without AVX-512).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.decoder.rope import apply_rope
from specdecode.models.formats.dflash import save_dflash
from specdecode.models.formats.speculators_export import save_block_speculators
from specdecode.models.heads.dflash import DFlashConfig, DFlashModel
from specdecode.models.loader import LoadedModel
from specdecode.models.model_config import ModelConfig
from specdecode.training.eagle3 import aux_layer_ids, default_layer_ids, feature_columns, max_positions
from specdecode.training.features import Shard
from specdecode.training.from_target import check_copyable_layers, dense_weight, verifier
from specdecode.training.loop import Trainee, TrainSettings, bf16_fast, train_drafter
from specdecode.training.ttt import UnrollResult

DECAY = 4.0  # slot j's loss weighs exp(-(j-1)/DECAY), as DeepSpec's and speculators' recipes


def new_dflash(target: LoadedModel, settings: TrainSettings, block_size: int,
               make: Callable[[DFlashConfig], DFlashModel] | None = None,
               boundaries: tuple[int, ...] | None = None) -> DFlashModel:
    """`settings.modules` layers starting from the target's last ones (attention and norms; the MLP too when its
    width is the target's), the fc random, the output norm the target's; `make(config)` builds the model (a
    DSpark drafter adds its heads), else a DFlash drafter; it reads the target's `boundaries` (default:
    EAGLE-3's)."""
    check_copyable_layers(target, "DFlash and DSpark", settings.modules)
    tc = target.config
    layer = ModelConfig(architecture="qwen3", vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                        intermediate_size=settings.intermediate_size or tc.intermediate_size,
                        num_layers=settings.modules, num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads,
                        head_dim=tc.head_dim, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
                        rope_scaling=tc.rope_scaling, max_position_embeddings=tc.max_position_embeddings,
                        qk_norm=True, qkv_bias=tc.qkv_bias, o_bias=tc.qkv_bias)
    ids = tuple(b - 1 for b in boundaries or default_layer_ids(tc.num_layers))  # in DFlash's "output of" ids
    config = DFlashConfig(layer=layer, target_layer_ids=ids, block_size=block_size, mask_token_id=tc.vocab_size - 1,
                          target_hidden_size=tc.hidden_size, causal_layers=(False,) * settings.modules,
                          windows=(None,) * settings.modules)
    torch.manual_seed(settings.seed)
    model = make(config) if make else DFlashModel(config, target.model.embed, target.model.lm_head)
    trunk = target.model
    q_rows = tc.num_heads * tc.head_dim
    with torch.no_grad():
        nn.init.normal_(model.fc.weight, std=0.02)
        model.norm.weight.copy_(trunk.norm.weight.float())
        for ours, theirs in zip(model.layers, trunk.layers[-settings.modules:]):
            qkv, qkv_bias = dense_weight(theirs.attn.qkv, tc.hidden_size, trunk.dtype, trunk.device)
            ours.q.weight.copy_(qkv[:q_rows])
            ours.kv.weight.copy_(qkv[q_rows:])
            if qkv_bias is not None:
                ours.q.bias.copy_(qkv_bias[:q_rows])
                ours.kv.bias.copy_(qkv_bias[q_rows:])
            ours.o.weight.copy_(dense_weight(theirs.attn.o, q_rows, trunk.dtype, trunk.device)[0])
            ours.attn_norm.weight.copy_(theirs.attn_norm.weight.float())
            ours.mlp_norm.weight.copy_(theirs.mlp_norm.weight.float())
            if layer.intermediate_size == tc.intermediate_size:
                ours.mlp.gate_up.weight.copy_(dense_weight(theirs.mlp.gate_up, tc.hidden_size, trunk.dtype,
                                                           trunk.device)[0])
                ours.mlp.down.weight.copy_(dense_weight(theirs.mlp.down, tc.intermediate_size, trunk.dtype,
                                                        trunk.device)[0])
    return model.to(settings.device)


def block_objective(model: DFlashModel, columns: torch.Tensor, rows: torch.Tensor, anchors: int,
                    keep_logits: bool = False) -> Callable[[Shard, torch.Tensor], UnrollResult]:
    """The anchored-block loss of one sequence (see the module docstring); rows [V, H]: the target's head;
    keep_logits: the result's logits hold [A, B-1, V] (tests compare them with drafting)."""
    block, device = model.config.block_size, model.device

    def objective(shard: Shard, target_to_draft: torch.Tensor) -> UnrollResult:
        length = shard.tokens.numel()
        blocks = anchored_blocks(model, columns, shard, anchors)
        out = blocks.hidden[:, 1:]  # [A, B-1, H]: the drafting slots
        logits = (out @ rows.T.to(out.dtype)).float()  # [A, B-1, V]
        label_at = (blocks.positions[:, 1:] - 1).clamp_max(length - 1)  # [A, B-1]: the target's row for slot j
        valid = blocks.inside[:, 1:] & shard.loss_mask[label_at]  # [A, B-1]
        log_q = torch.log_softmax(logits, dim=-1)  # [A, B-1, V]
        per_slot = soft_cross_entropy(log_q, shard, label_at)  # [A, B-1]
        decay = torch.exp(-torch.arange(block - 1, device=device) / DECAY)  # [B-1]
        loss_sum = (per_slot * valid * decay).sum().view(1)  # [1]: averaged over the valid slots
        correct, counted = chained_hits(log_q.argmax(-1), shard, label_at, valid)
        kept = [logits.detach()] if keep_logits else []
        return UnrollResult(loss_sum, valid.sum().float().view(1), correct, counted, kept)

    return objective


@dataclass
class AnchoredBlocks:
    hidden: torch.Tensor  # [A, B, H] every slot's output after the output norm
    positions: torch.Tensor  # [A, B] each slot's position
    inside: torch.Tensor  # [A, B] bool: the slot's position lies inside the sequence


def anchored_blocks(model: DFlashModel, columns: torch.Tensor, shard: Shard, anchors: int) -> AnchoredBlocks:
    """A sequence's anchored blocks [x_a, MASK x (B-1)] through the backbone in one forward: each block sees
    the target's context strictly before its anchor, and its own slots (not the other blocks)."""
    block, device = model.config.block_size, model.device
    length = shard.tokens.numel()
    starts = choose_anchors(shard, anchors, block)  # [A]
    count = starts.numel()
    positions = starts.view(-1, 1) + torch.arange(block, device=device)  # [A, B]
    tokens = torch.full((count, block), model.config.mask_token_id, dtype=torch.long, device=device)  # [A, B]
    tokens[:, 0] = shard.tokens[starts]
    x = model.embed_block(tokens.flatten())  # [A*B, H]
    context = model.hidden_norm(model.fc(shard.hidden[:, columns].to(model.dtype)))  # [T, H]
    mask = _block_mask(starts, length, block)  # [A*B, T + A*B]
    cos_ctx, sin_ctx = model.rope.lookup(torch.arange(length, device=device).view(1, -1))
    cos, sin = model.rope.lookup(positions.view(1, -1))  # [1, 1, A*B, D/2]
    for layer in model.layers:
        normed = layer.attn_norm(x)
        q = layer.q(normed).view(-1, layer.heads, layer.dim)  # [A*B, h, D]
        q = apply_rope(layer.q_norm(q).transpose(0, 1).unsqueeze(0), cos, sin)  # [1, h, A*B, D]
        k_ctx, v_ctx = layer.keys_values(context, cos_ctx, sin_ctx)  # [1, hkv, T, D]
        k_blk, v_blk = layer.keys_values(normed, cos, sin)  # [1, hkv, A*B, D]
        group = layer.heads // layer.kv_heads
        keys = torch.cat([k_ctx, k_blk], dim=2).repeat_interleave(group, dim=1)  # [1, h, T+A*B, D]
        values = torch.cat([v_ctx, v_blk], dim=2).repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [1, h, A*B, D]
        x = x + layer.o(attn[0].transpose(0, 1).reshape(-1, layer.heads * layer.dim))
        x = x + layer.mlp(layer.mlp_norm(x))
    return AnchoredBlocks(model.norm(x).view(count, block, -1), positions, positions < length)


def soft_cross_entropy(log_q: torch.Tensor, shard: Shard, label_at: torch.Tensor) -> torch.Tensor:
    """log_q [A, S, V] the drafter's log-probabilities, label_at [A, S] the target's row for each slot's token ->
    [A, S] cross-entropy against the target's top-K, renormalized."""
    weights = shard.top_logprobs[label_at].exp()  # [A, S, K]
    weights = weights / weights.sum(-1, keepdim=True)
    return -(weights * log_q.gather(-1, shard.top_ids[label_at])).sum(-1)


def chained_hits(drafts: torch.Tensor, shard: Shard, label_at: torch.Tensor, valid: torch.Tensor
                 ) -> tuple[list[int], list[int]]:
    """drafts [A, S] the drafter's greedy tokens -> per slot, (accepted, reached) counts: a slot is reached when every
    slot before it named the target's own token, as verification would reach it, so accepted / reached is the
    slot's acceptance given the drafts before it were right (what the loop's evaluate reports for every kind)."""
    hits = (drafts == shard.top_ids[label_at][..., 0]) & valid  # [A, S]
    chained = hits.int().cumprod(dim=1).bool()  # [A, S]: this slot and every one before it right
    before = torch.cat([torch.ones_like(chained[:, :1]), chained[:, :-1]], dim=1)  # [A, S]: every one before right
    reached = valid.int().cumprod(dim=1).bool() & before  # [A, S]
    return chained.sum(0).tolist(), reached.sum(0).tolist()


def head_rows(target: LoadedModel, draft_ids: torch.Tensor, device: str) -> torch.Tensor:
    """The target's output rows [V, H] for the loss, in bf16 where bf16 matmuls are fast, else float32 (a bf16
    matmul without AVX-512 is compute-bound, and converting the rows at every step costs more)."""
    dtype = torch.bfloat16 if bf16_fast(device) else torch.float32
    return target.model.output_rows(draft_ids).to(device=device, dtype=dtype)


def choose_anchors(shard: Shard, anchors: int, block: int) -> torch.Tensor:
    """Up to `anchors` block starts a (1 <= a < T-1, slot 1's token learnt), the same ones for the same
    sequence every time (the generator is seeded by its tokens), ascending -> [A] long."""
    length = shard.tokens.numel()
    candidates = torch.nonzero(shard.loss_mask[1 : length - 1]).flatten() + 1  # a with loss_mask[a]
    if candidates.numel() == 0:
        candidates = torch.arange(1, max(2, length - 1), device=shard.tokens.device)
    generator = torch.Generator().manual_seed(int(shard.tokens.sum()) * 31 + length)
    order = torch.randperm(candidates.numel(), generator=generator)[:anchors]
    return candidates[order.to(candidates.device)].sort().values


def _block_mask(starts: torch.Tensor, length: int, block: int) -> torch.Tensor:
    """[A*B, T + A*B] bool: a block's slots see the context before its anchor and their own block."""
    count = starts.numel()
    device = starts.device
    anchor_of_row = starts.repeat_interleave(block).view(-1, 1)  # [A*B, 1]
    context = torch.arange(length, device=device).view(1, -1) < anchor_of_row  # [A*B, T]
    block_of_row = torch.arange(count, device=device).repeat_interleave(block)  # [A*B]
    own = block_of_row.view(-1, 1) == block_of_row.view(1, -1)  # [A*B, A*B]
    return torch.cat([context, own], dim=1)


def train_dflash(target: LoadedModel, features: Path, out: Path, settings: TrainSettings, quiet: bool = False,
                 on_eval: Callable[[int, int, dict[str, list[float]]], None] | None = None,
                 speculators: bool = False) -> dict:
    """Train a DFlash drafter on the shards in `features`; write it to `out` in z-lab's layout (or with
    `speculators` in vLLM's speculators layout)."""
    stored = tuple(json.loads((features / "manifest.json").read_text())["layer_ids"])
    boundaries = aux_layer_ids(stored, target.config.num_layers)
    columns = feature_columns(stored, boundaries, target.config.hidden_size).to(settings.device)
    vocab = target.config.vocab_size

    def build(draft_ids: torch.Tensor) -> Trainee:
        model = new_dflash(target, settings, settings.block_size, boundaries=boundaries)
        model.finish_loading(max_positions(features) + settings.block_size)
        rows = head_rows(target, draft_ids, settings.device)  # [V, H]
        def save(folder: Path) -> None:
            if speculators:
                save_block_speculators(model, folder, verifier(target))
            else:
                save_dflash(model, folder, target.config)

        return Trainee("dflash", model, block_objective(model, columns, rows, settings.anchors), save)

    return train_drafter(build, lambda files: torch.arange(vocab), target, features, out, settings, quiet, on_eval)
