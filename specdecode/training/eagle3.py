"""Train an EAGLE-3 head for a target on this machine, in the one training loop (loop.py): the head starts as
the target's own last step (its output rows and final norm), reads the fused features of three boundaries, and is
written in the reference layout that vLLM and SGLang read (formats/eagle3.py, save_eagle3_head)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.layers import Attention
from specdecode.models.formats.eagle3 import save_eagle3_head
from specdecode.models.formats.speculators_export import save_eagle3_speculators
from specdecode.models.heads.eagle3 import Eagle3Config, Eagle3Head
from specdecode.models.loader import LoadedModel
from specdecode.models.model_config import ModelConfig
from specdecode.training.from_target import draft_vocabulary, verifier
from specdecode.training.loop import Trainee, TrainSettings, train_drafter, unrolled


def default_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The reference's boundaries (2, L//2, L-3), made distinct and in range for shallow models."""
    ids = sorted({min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)})
    return tuple(ids) if len(ids) == 3 else tuple(range(max(num_layers - 2, 0), num_layers + 1))


def feature_layer_ids(num_layers: int) -> tuple[int, ...]:
    """The boundaries a features folder keeps: EAGLE-3's three and the last (MTP's), ascending."""
    return tuple(sorted({*default_layer_ids(num_layers), num_layers}))


def aux_layer_ids(stored: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The boundaries a head reads from features holding `stored`: EAGLE-3's three where the features keep them
    (ours always do, and vLLM's hidden states at speculators' default ids), else every stored one but the last
    layer (vLLM served with other --target-layer-ids)."""
    wanted = default_layer_ids(num_layers)
    if set(wanted) <= set(stored):
        return wanted
    others = tuple(i for i in stored if i != num_layers)
    if not others:
        raise SpecDecodeError("the features hold the last layer alone: a head reads earlier layers too")
    return others


def feature_columns(stored: tuple[int, ...], wanted: tuple[int, ...], width: int) -> torch.Tensor:
    """Column indices [len(wanted) * width] of the boundaries `wanted` in features holding `stored` (ascending)."""
    return torch.cat([torch.arange(width) + stored.index(i) * width for i in wanted])


class Eagle3Unroll:
    """An EAGLE-3 head as the training-time test runs it (ttt.UnrollLayer)."""

    def __init__(self, head: Eagle3Head, columns: torch.Tensor):
        self.head, self.layer = head, head.layer
        self.columns = columns.to(head.device)  # [n_aux * Ht] which feature columns the head reads
        self.rope, self.device, self.dtype = head.rope, head.device, head.dtype

    def first_hidden(self, features: torch.Tensor) -> torch.Tensor:
        chosen = features[:, self.columns]  # [N, n_aux*Ht]
        return self.head.fuse(list(chosen.split(self.head.config.target_hidden_size, dim=-1)))  # [N, H]

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head.embed_tokens(tokens.view(1, -1))[0]  # [N, H]

    def module_of(self, step: int) -> int:
        return 0

    def attention_inputs(self, step: int, hidden: torch.Tensor, embeds: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        normed = self.layer.hidden_norm(hidden)  # [N, H]
        attn_in = torch.cat([self.layer.input_norm(embeds), normed], dim=-1)  # [N, 2H], embedding first
        return attn_in, normed if self.layer.norm_before_residual else hidden

    def attention(self, step: int) -> Attention:
        return self.layer.attn

    def finish(self, step: int, after_attention: torch.Tensor) -> torch.Tensor:
        return after_attention + self.layer.mlp(self.layer.mlp_norm(after_attention))

    def logits(self, step: int, out: torch.Tensor) -> torch.Tensor:
        return self.head.lm_head(self.head.norm(out)).float()  # [N, Vd]

    def feed_back(self, step: int, out: torch.Tensor) -> torch.Tensor:
        return self.head.norm(out) if self.head.config.norm_output else out


def new_head(target: LoadedModel, layer_ids: tuple[int, ...], draft_ids: torch.Tensor,
             settings: TrainSettings) -> Eagle3Head:
    """A head for the target: the target's attention shape and rope, its output rows and final norm as the
    start of lm_head and norm (the head then starts as the target's own last step), the rest random."""
    tc = target.config
    layer = ModelConfig(architecture="llama", vocab_size=tc.vocab_size, hidden_size=tc.hidden_size,
                        intermediate_size=settings.intermediate_size or tc.intermediate_size, num_layers=1,
                        num_heads=tc.num_heads, num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim,
                        rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling,
                        max_position_embeddings=tc.max_position_embeddings)
    config = Eagle3Config(layer=layer, target_hidden_size=tc.hidden_size, draft_vocab_size=draft_ids.numel(),
                          layer_ids=layer_ids)
    torch.manual_seed(settings.seed)
    head = Eagle3Head(config, target.model.embed)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.model.output_rows(draft_ids))
        head.norm.weight.copy_(target.model.norm.weight.float())
    head.draft_to_target = draft_ids.clone()
    return head.to(settings.device)


def train_eagle3(target: LoadedModel, features: Path, out: Path, settings: TrainSettings, quiet: bool = False,
                 on_eval: Callable[[int, int, dict[str, list[float]]], None] | None = None,
                 speculators: bool = False) -> dict:
    """Train on the shards in `features` and write the head to `out` (the reference layout, or with
    `speculators` vLLM's speculators layout) -> the last held-out measurement."""
    stored = tuple(json.loads((features / "manifest.json").read_text())["layer_ids"])
    layer_ids = aux_layer_ids(stored, target.config.num_layers)
    columns = feature_columns(stored, layer_ids, target.config.hidden_size)

    def build(draft_ids: torch.Tensor) -> Trainee:
        head = new_head(target, layer_ids, draft_ids, settings)
        head.finish_loading(max_positions(features))
        def save(folder: Path) -> None:
            if speculators:
                save_eagle3_speculators(head, folder, verifier(target))
            else:
                save_eagle3_head(head, folder, target.config)

        return Trainee("eagle3", head, unrolled(Eagle3Unroll(head, columns), settings.steps), save)

    def vocabulary(files: list[Path]) -> torch.Tensor:
        return draft_vocabulary(files, settings.draft_vocab, target.config.vocab_size)

    return train_drafter(build, vocabulary, target, features, out, settings, quiet, on_eval)


def max_positions(features: Path) -> int:
    """Rope positions a drafter needs for the feature folder's sequences (its manifest's max_len, and room)."""
    return int(json.loads((features / "manifest.json").read_text())["max_len"]) + 8
