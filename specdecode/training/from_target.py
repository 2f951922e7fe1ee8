"""What a drafter starts from or trains against, taken from the frozen target: its frequent tokens and its
layers' weights, in float whatever the target's storage (a w4a8 target included); its output head's rows come
from Transformer.output_rows."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.families.registry import config_to_hf
from specdecode.models.formats.speculators_export import Verifier
from specdecode.models.loader import LoadedModel
from specdecode.training.features import load_shard


def verifier(target: LoadedModel) -> Verifier:
    """The target as a speculators export records it: the name it was given and its architectures."""
    return Verifier(target.name, config_to_hf(target.config)["architectures"])


def draft_vocabulary(files: list[Path], size: int, vocab: int) -> torch.Tensor:
    """The `size` most frequent target ids among the tokens and the target's own next tokens, ascending (as the
    reference sorts its used tokens) -> [Vd] long."""
    counts = torch.zeros(vocab, dtype=torch.long)  # [V]
    for path in files:
        shard = load_shard(path)
        counts += torch.bincount(shard.tokens, minlength=vocab) + torch.bincount(shard.top_ids[:, 0], minlength=vocab)
    size = min(size, vocab)
    return counts.topk(size).indices.sort().values


def check_copyable_layers(target: LoadedModel, kind: str, count: int) -> None:
    """MTP modules and DFlash/DSpark drafters start as copies of the target's last `count` layers: grouped-query
    attention (attn.qkv) over a dense MLP (mlp.gate_up). A target whose layers are otherwise (latent attention, a
    mixture of experts, a recurrent layer) is one clear error, not an AttributeError mid-copy."""
    for layer in target.model.layers[-count:]:
        attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
        if not (hasattr(attn, "qkv") and hasattr(mlp, "gate_up")):
            raise SpecDecodeError(
                f"{kind} drafters start as copies of the target's last layers, and {target.name}'s last layers "
                "(latent attention, a mixture of experts or a recurrent layer) cannot be copied into one yet; "
                "'specdecode train eagle3' trains a head for any target")


def dense_weight(layer: nn.Module, in_features: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer of any storage -> (weight [N, K] float32, bias [N] or None), read off its outputs: on the
    identity (minus the bias, its output on zeros) as Transformer.output_rows reads a head."""
    with torch.inference_mode():
        bias = getattr(layer, "bias", None)
        zero = layer(torch.zeros(1, in_features, dtype=dtype, device=device)).float()[0] if bias is not None else None
        eye = torch.eye(in_features, dtype=dtype, device=device)  # [K, K]
        rows = torch.cat([layer(eye[i : i + 256]).float() for i in range(0, in_features, 256)])  # [K, N]
        if zero is not None:
            rows = rows - zero
    return rows.T.contiguous().clone(), None if zero is None else zero.clone()
