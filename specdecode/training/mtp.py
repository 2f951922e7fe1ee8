"""Train MTP modules onto a target that has none, in the one training loop (loop.py), from the same cached
features as EAGLE-3 (the last boundary, normed by the target's final norm, is the hidden state MTP reads).

Each module starts as the target's last decoder layer, with a projection that passes the hidden state through
and the target's final norm on its output, so it begins as "the target's last step again" and learns from
there. Draft step k uses module min(k, K-1), as the `mtp` drafter does. The loss runs over the `draft_vocab`
lowest token ids and the end-of-turn tokens (the vocabulary `--mtp-draft-vocab` drafts over): the full output
head's 151,936 rows per position would cost more than the module itself on a CPU. The result is written with
the target's weights (formats/mtp_export.py): a model folder in MiMo naming for a Qwen2 trunk (DeepSeek naming
otherwise), and, when the target came from a GGUF file, that file with the nextn tensors added.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from specdecode.models.decoder.layers import Attention
from specdecode.models.decoder.mtp import MTPModule
from specdecode.models.decoder.rope import RopeTable, inverse_frequencies
from specdecode.models.formats.mtp_export import mtp_layout, write_model_with_mtp
from specdecode.models.heads.draft_vocab import frequent_ids
from specdecode.models.loader import LoadedModel, float_folder, resolve_source
from specdecode.training.eagle3 import feature_columns, max_positions
from specdecode.training.from_target import check_copyable_layers, dense_weight
from specdecode.training.loop import Trainee, TrainSettings, train_drafter, unrolled


def mtp_vocabulary(target: LoadedModel, size: int) -> torch.Tensor:
    """The ids the loss covers [Vd]: the `mtp` drafter's `mtp_draft_vocab` choice for the same size."""
    return frequent_ids(size, target.config.vocab_size, target.tokenizer.eos_token_ids)


class MTPUnroll:
    """MTP modules as the training-time test runs them (ttt.UnrollLayer)."""

    def __init__(self, target: LoadedModel, modules: nn.ModuleList, column: torch.Tensor, rows: torch.Tensor,
                 max_positions: int):
        self.target, self.modules = target.model, modules
        self.column = column  # [H] the feature columns of the target's last boundary
        self.rows = rows  # [Vd, H] the target's output rows, frozen
        self.device, self.dtype = rows.device, torch.float32
        self.rope = RopeTable(inverse_frequencies(target.config), max_positions, torch.float32, rows.device)

    def first_hidden(self, features: torch.Tensor) -> torch.Tensor:
        last = features[:, self.column.to(features.device)].to(self.target.dtype)  # [N, H], before the final norm
        return self.target.norm(last).float()  # [N, H]: what lm_head reads, and MTP

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.target.embed(tokens).float()  # [N, H]

    def module_of(self, step: int) -> int:
        return min(step, len(self.modules) - 1)

    def attention_inputs(self, step: int, hidden: torch.Tensor, embeds: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        module = self.modules[self.module_of(step)]
        parts = [module.token_norm(embeds), module.hidden_norm(hidden)]
        joined = torch.cat(parts[::-1] if module.hidden_first else parts, dim=-1)  # [N, 2H]
        projected = module.proj(joined)  # [N, H]: the block's input and residual
        return module.block.attn_norm(projected), projected

    def attention(self, step: int) -> Attention:
        return self.modules[self.module_of(step)].block.attn

    def finish(self, step: int, after_attention: torch.Tensor) -> torch.Tensor:
        block = self.modules[self.module_of(step)].block
        return after_attention + block.mlp(block.mlp_norm(after_attention))

    def logits(self, step: int, out: torch.Tensor) -> torch.Tensor:
        normed = self.modules[self.module_of(step)].out_norm(out)  # [N, H]
        return (normed @ self.rows.T.to(normed.dtype)).float()  # [N, Vd]

    def feed_back(self, step: int, out: torch.Tensor) -> torch.Tensor:
        return out


def new_modules(target: LoadedModel, count: int, settings: TrainSettings) -> nn.ModuleList:
    """`count` modules, each starting as the target's last layer with a pass-through projection."""
    check_copyable_layers(target, "MTP", 1)
    config = replace(target.config, mtp_layers=count, mtp_declared=count, mtp_layout=mtp_layout(target.config))
    torch.manual_seed(settings.seed)
    model, hidden = target.model, config.hidden_size
    trunk = type(model)  # the family's trunk builds the block its MTP layers use
    modules = nn.ModuleList(MTPModule(config, trunk.build_mtp_block(config), trunk.mtp_feeds_back_normed)
                            for _ in range(count))
    last = model.layers[-1]
    with torch.no_grad():
        for module in modules:
            block = module.block
            for ours, theirs in ((block.attn.qkv, last.attn.qkv), (block.attn.o, last.attn.o),
                                 (block.mlp.gate_up, last.mlp.gate_up), (block.mlp.down, last.mlp.down)):
                weight, bias = dense_weight(theirs, ours.in_features, model.dtype, model.device)
                ours.weight.copy_(weight)
                if bias is not None:
                    ours.bias.copy_(bias)
            for ours, theirs in ((block.attn_norm, last.attn_norm), (block.mlp_norm, last.mlp_norm),
                                 (block.attn.q_norm, last.attn.q_norm), (block.attn.k_norm, last.attn.k_norm),
                                 (module.out_norm, model.norm)):
                if ours is not None:
                    ours.weight.copy_(theirs.weight.float())
            nn.init.normal_(module.proj.weight, std=0.02)
            hidden_half = slice(0, hidden) if module.hidden_first else slice(hidden, 2 * hidden)
            module.proj.weight[:, hidden_half] += torch.eye(hidden)
    return modules.to(settings.device)


def train_mtp(target: LoadedModel, features: Path, out: Path, settings: TrainSettings, quiet: bool = False,
              on_eval: Callable[[int, int, dict[str, list[float]]], None] | None = None) -> dict:
    """Train `settings.modules` MTP modules on the shards in `features`; write the model with them to `out`."""
    stored = tuple(json.loads((features / "manifest.json").read_text())["layer_ids"])
    column = feature_columns(stored, (target.config.num_layers,), target.config.hidden_size)

    def build(draft_ids: torch.Tensor) -> Trainee:
        modules = new_modules(target, settings.modules, settings)
        rows = target.model.output_rows(draft_ids).to(settings.device)  # [Vd, H]
        layer = MTPUnroll(target, modules, column, rows, max_positions(features))
        return Trainee("mtp", modules, unrolled(layer, settings.steps),
                       lambda folder: write_model_with_mtp(
                           target.config, target.model.dtype, float_folder(target.name, target.model.dtype, quiet),
                           resolve_source(target.name, quiet=True), modules, folder, quiet))

    return train_drafter(build, lambda files: mtp_vocabulary(target, settings.draft_vocab), target, features,
                         out, settings, quiet, on_eval)
