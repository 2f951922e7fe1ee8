"""Train a DSpark drafter for a target on this machine: DFlash's anchored blocks (dflash.py) in DeepSpec's
slot convention, with its Markov and confidence heads, in the one training loop (loop.py) on the shared features.

Slot k of a block anchored at a predicts the token at a+k+1 (slot 0 included), from the target's row a+k. Its
logits are the head's plus the Markov correction by the token before it, teacher-forced (the data's token at
a+k, the anchor's for slot 0): all slots in one projection (only the rnn kind's state runs slot after slot). Per
slot, weighted exp(-k/4) and masked as DeepSpec's loss (deepspec/modeling/dspark/loss.py):

    cross-entropy against the target's top-K (renormalized)                        weight CE_WEIGHT
    total variation |q - p|_1 against the same p (q's mass outside the top-K counts whole)   weight TV_WEIGHT
    binary cross-entropy of the confidence logit against 1 - TV/2 (the chance a
    sampled draft is accepted), the target detached                                weight 1

DeepSpec weighs CE 0.1 and TV 0.9 for long GPU runs. TV's gradient is proportional to the draft's mass on the
target's tokens, which starts near zero, so in the hour a CPU allows CE carries the start: both weigh 1 here.
The Markov projection starts at zero (the drafter starts as a DFlash backbone), the confidence head at 0.5.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.formats.dspark import save_dspark
from specdecode.models.formats.speculators_export import save_block_speculators
from specdecode.models.heads.dspark import DSparkHeads, DSparkModel
from specdecode.models.loader import LoadedModel
from specdecode.training.dflash import DECAY, anchored_blocks, chained_hits, head_rows, new_dflash, soft_cross_entropy
from specdecode.training.eagle3 import aux_layer_ids, feature_columns, max_positions
from specdecode.training.features import Shard
from specdecode.training.from_target import verifier
from specdecode.training.loop import Trainee, TrainSettings, train_drafter
from specdecode.training.ttt import UnrollResult

CE_WEIGHT = 1.0
TV_WEIGHT = 1.0


def new_dspark(target: LoadedModel, settings: TrainSettings, heads: DSparkHeads,
               boundaries: tuple[int, ...] | None = None) -> DSparkModel:
    """DFlash's starting point (new_dflash) with DSpark's heads: the Markov projection zero, the confidence 0.5."""
    model = new_dflash(target, settings, settings.block_size,
                       lambda config: DSparkModel(config, heads, target.model.embed, target.model.lm_head),
                       boundaries)
    with torch.no_grad():
        if model.markov_head is not None:
            nn.init.normal_(model.markov_head.markov_w1.weight, std=0.02)
            nn.init.zeros_(model.markov_head.markov_w2.weight)
        if model.confidence_head is not None:
            nn.init.zeros_(model.confidence_head.proj.weight)
            nn.init.zeros_(model.confidence_head.proj.bias)
    return model.to(settings.device)


def dspark_objective(model: DSparkModel, columns: torch.Tensor, rows: torch.Tensor, anchors: int,
                     keep_logits: bool = False) -> Callable[[Shard, torch.Tensor], UnrollResult]:
    """One sequence's DSpark loss (the module docstring); rows [V, H] the target's head; keep_logits: the
    result's logits hold the corrected logits [A, B, V] and the confidence logits [A, B] (tests compare them
    with drafting)."""
    block, device = model.config.block_size, model.device

    def objective(shard: Shard, target_to_draft: torch.Tensor) -> UnrollResult:
        length = shard.tokens.numel()
        blocks = anchored_blocks(model, columns, shard, anchors)
        hidden = blocks.hidden  # [A, B, H]
        label_at = blocks.positions.clamp_max(length - 1)  # [A, B]: the target's row for slot k's token
        valid = blocks.inside & shard.loss_mask[label_at]  # [A, B]
        previous = shard.tokens[label_at]  # [A, B]: the token before slot k's, teacher-forced
        base = (hidden @ rows.T.to(hidden.dtype)).float()  # [A, B, V]
        logits, confidence = model.forced_logits(base, hidden, previous)  # [A, B, V], [A, B] or None
        log_q = torch.log_softmax(logits, dim=-1)
        top_p = shard.top_logprobs[label_at].exp()  # [A, B, K]
        top_p = top_p / top_p.sum(-1, keepdim=True)
        top_q = log_q.gather(-1, shard.top_ids[label_at]).exp()  # [A, B, K]
        total_variation = (top_q - top_p).abs().sum(-1) + (1 - top_q.sum(-1)).clamp_min(0)  # [A, B]
        per_slot = CE_WEIGHT * soft_cross_entropy(log_q, shard, label_at) + TV_WEIGHT * total_variation
        if confidence is not None:
            accepted = (1 - 0.5 * total_variation.detach()).clamp(0, 1)  # [A, B]
            per_slot = per_slot + F.binary_cross_entropy_with_logits(confidence, accepted, reduction="none")
        weight = valid * torch.exp(-torch.arange(block, device=device) / DECAY)  # [A, B]
        loss_sum = (per_slot * weight).sum().view(1)  # [1]: averaged by the slots' total weight
        correct, counted = chained_hits(log_q.argmax(-1), shard, label_at, valid)
        kept = []
        if keep_logits:
            kept = [logits.detach()] + ([confidence.detach()] if confidence is not None else [])
        return UnrollResult(loss_sum, weight.sum().float().detach().view(1), correct, counted, kept)

    return objective


def train_dspark(target: LoadedModel, features: Path, out: Path, settings: TrainSettings, quiet: bool = False,
                 on_eval: Callable[[int, int, dict[str, list[float]]], None] | None = None,
                 speculators: bool = False) -> dict:
    """Train a DSpark drafter on the shards in `features`; write it to `out` in DeepSpec's layout (or with
    `speculators` in vLLM's speculators layout)."""
    stored = tuple(json.loads((features / "manifest.json").read_text())["layer_ids"])
    boundaries = aux_layer_ids(stored, target.config.num_layers)
    columns = feature_columns(stored, boundaries, target.config.hidden_size).to(settings.device)
    vocab = target.config.vocab_size
    heads = DSparkHeads(markov_rank=settings.markov_rank, markov_kind=settings.markov_kind, confidence=True,
                        confidence_with_markov=settings.markov_rank > 0)

    def build(draft_ids: torch.Tensor) -> Trainee:
        model = new_dspark(target, settings, heads, boundaries)
        model.finish_loading(max_positions(features) + settings.block_size)
        rows = head_rows(target, draft_ids, settings.device)  # [V, H]
        def save(folder: Path) -> None:
            if speculators:
                save_block_speculators(model, folder, verifier(target))
            else:
                save_dspark(model, folder, target.config, settings.anchors)

        return Trainee("dspark", model, dspark_objective(model, columns, rows, settings.anchors), save)

    return train_drafter(build, lambda files: torch.arange(vocab), target, features, out, settings, quiet, on_eval)
