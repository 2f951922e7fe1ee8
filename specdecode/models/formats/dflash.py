"""DFlash drafters as z-lab ships them (HF `z-lab/*-DFlash*`, drafter-formats.md section 3), read into our
DFlashModel, and ours written the same way.

config.json: a Qwen3 config plus `dflash_config` {target_layer_ids ("output of layer k"), mask_token_id,
block_size, causal, ...}; `block_size` and `num_target_layers` may also sit at the top level (older
checkpoints), and the reference reads every DFlash key from `dflash_config` first. Tensors: `fc`,
`hidden_norm`, `layers.{i}.*` (a Qwen3 decoder layer), `norm`; an optional `model.` prefix and vLLM's aliases
(`midlayer.` for `layers.0.`, `encoder.fc.`, `encoder.output_norm_enc.`) are read too. The embedding and the
output head are the target's: copies stored in a checkpoint are left unread, except the rows of a reduced
draft vocabulary (`d2t`). vLLM's speculators layout is translated on the way in (speculators.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder import llama_config
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.formats.drafter_folder import load_checked, read_drafter_config, write_drafter_folder
from specdecode.models.formats.speculators import VOCAB_MAPS, draft_vocabulary, is_speculators, native_form
from specdecode.models.formats.weight_source import FolderWeights
from specdecode.models.heads.dflash import DFlashConfig, DFlashModel
from specdecode.models.model_config import ModelConfig

# Published names inside a layer -> ours; k and v are stacked into one projection.
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "mlp_norm.weight",
               "self_attn.q_proj.weight": "q.weight", "self_attn.q_proj.bias": "q.bias",
               "self_attn.o_proj.weight": "o.weight", "self_attn.o_proj.bias": "o.bias",
               "self_attn.q_norm.weight": "q_norm.weight", "self_attn.k_norm.weight": "k_norm.weight",
               "mlp.down_proj.weight": "mlp.down.weight"}
STACKED = {"kv": ("self_attn.k_proj", "self_attn.v_proj"), "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj")}
ALIASES = {"midlayer.": "layers.0.", "encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
SHARED_COPIES = frozenset({"embed_tokens.weight", "lm_head.weight"})  # the target's own are used


def load_dflash(path: str | Path, target: Transformer, max_positions: int) -> tuple[DFlashModel, str]:
    """The drafter in folder `path`, checked against `target`, in its dtype and device -> (model, one line)."""
    folder = Path(path)
    hf, layout = block_drafter_config(folder, "dflash")
    config = dflash_config(hf, target.config, folder)
    model = DFlashModel(config, target.embed, target.lm_head)
    fill(model, folder, target, max_positions)
    vocabulary = draft_vocabulary(folder, target.config.vocab_size, config.layer.hidden_size)
    if vocabulary is not None:
        model.use_draft_vocabulary(*vocabulary)
    ids = ", ".join(map(str, config.target_layer_ids))
    vocab = f", a {len(vocabulary[0])}-token draft vocabulary" if vocabulary is not None else ""
    return model, (f"DFlash drafter {folder.name} ({layout} layout, {config.layer.num_layers} layers, block "
                   f"{config.block_size}, target layers {ids}{vocab})")


def fill(model: DFlashModel, folder: Path, target: Transformer, max_positions: int, own_prefixes: tuple[str, ...] = (),
         what: str = "DFlash drafter", unread: frozenset[str] = SHARED_COPIES | VOCAB_MAPS) -> None:
    """Load the folder's tensors into `model` (checked), in the target's dtype and device, ready to draft;
    `unread`: stored tensors that are not parameters (the target's copies, a draft vocabulary's maps)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SpecDecodeError(f"{folder} holds no *.safetensors weights")
    load_checked(model, our_tensors(FolderWeights(files), folder, own_prefixes, what, unread), folder, what)
    model.to(dtype=target.dtype, device=target.device)
    model.finish_loading(max_positions)
    model.requires_grad_(False)


def dflash_config(hf: dict, target: ModelConfig, folder: Path) -> DFlashConfig:
    """The drafter's config, checked against the target it is to draft for."""
    nested = hf.get("dflash_config") or {}

    def value(name: str, default=None):  # the reference's rule: dflash_config first, then the top level
        return nested.get(name, hf.get(name, default))

    try:
        layer = llama_config.from_hf({**hf, "num_nextn_predict_layers": 0,
                                      "vocab_size": hf.get("vocab_size", target.vocab_size)}, "qwen3")
        layers = layer.num_layers
        target_layers = int(value("num_target_layers", target.num_layers))
        ids = value("target_layer_ids")
        ids = tuple(int(i) for i in ids) if ids is not None else default_target_layer_ids(target_layers, layers)
        block_size = int(value("block_size", 16))
        mask_token_id = value("mask_token_id")
        layer_types = hf.get("layer_types") or ["full_attention"] * layers
        causal_override = value("causal", hf.get("is_causal"))
    except (TypeError, ValueError) as error:
        raise SpecDecodeError(f"{folder}/config.json has a malformed DFlash field ({error})") from None
    mismatch = []
    if target_layers != target.num_layers:
        mismatch.append(f"it reads a {target_layers}-layer target, this one has {target.num_layers}")
    if layer.hidden_size != target.hidden_size or layer.vocab_size != target.vocab_size:
        mismatch.append(f"hidden size {layer.hidden_size} and vocabulary {layer.vocab_size} against the target's "
                        f"{target.hidden_size} and {target.vocab_size}")
    if not all(-1 <= i < target.num_layers for i in ids):  # -1: the embedding's output (DeepSpec's ids)
        mismatch.append(f"target layers {list(ids)} are not all below {target.num_layers}")
    if mismatch:
        raise SpecDecodeError(f"{folder} was not trained for this target: {'; '.join(mismatch)}")
    if type(mask_token_id) is not int or not 0 <= mask_token_id < target.vocab_size:
        raise SpecDecodeError(f"{folder}/config.json: dflash_config.mask_token_id must be a token id of the target, "
                              f"got {mask_token_id!r}")
    if not 2 <= block_size <= 64 or len(layer_types) != layers:
        raise SpecDecodeError(f"{folder}/config.json: block_size must be 2..64 and layer_types one per layer")
    sliding = [kind == "sliding_attention" for kind in layer_types]
    causal = tuple(bool(causal_override) if causal_override is not None else s for s in sliding)
    windows = tuple(int(hf["sliding_window"]) if s and hf.get("sliding_window") else None for s in sliding)
    softcap = value("final_logit_softcapping")
    return DFlashConfig(layer=layer, target_layer_ids=ids, block_size=block_size, mask_token_id=mask_token_id,
                        target_hidden_size=target.hidden_size, causal_layers=causal, windows=windows,
                        input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                        output_multiplier=float(value("output_multiplier", 1.0)),
                        logit_softcap=float(softcap) if softcap else None)


# Per slot convention: its home layout's name, and what a folder of the other convention is told.
_CONVENTIONS = {
    "dflash": ("z-lab", ("holds a drafter in DeepSpec's slot convention, whose every slot drafts (DSpark, or "
                         "DeepSpec's DFlash baseline): use --spec-type dspark")),
    "dspark": ("DeepSpec", "holds a DFlash drafter in z-lab's layout (slot 0 drafts nothing): use --spec-type dflash"),
}


def block_drafter_config(folder: Path, convention: str) -> tuple[dict, str]:
    """A DFlash ("dflash") or DSpark ("dspark") drafter folder's config in its native form, checked to be of that
    slot convention -> (config, the layout it was stored in: speculators' or the convention's own)."""
    home, mismatch = _CONVENTIONS[convention]
    hf = read_drafter_config(folder, f"a {'DFlash' if convention == 'dflash' else 'DSpark'} drafter")
    layout = "speculators" if is_speculators(hf) else home
    if layout == "speculators":
        hf = native_form(hf, folder)
    if slot_convention(hf) != convention:
        raise SpecDecodeError(f"{folder} {mismatch}")
    return hf, layout


def slot_convention(hf: dict) -> str:
    """"dspark" for DeepSpec's layout (every slot drafts, `sample_from_anchor`: its own DFlash baselines too, which
    have no Markov head), else "dflash" (z-lab's: slot 0 holds the root and drafts nothing)."""
    described = " ".join(map(str, hf.get("architectures") or [])).lower()
    nested = hf.get("dflash_config") or {}
    deepspec = "dspark" in described or hf.get("sample_from_anchor") is True or "markov_rank" in hf \
        or "markov_rank" in nested
    return "dspark" if deepspec else "dflash"


def default_target_layer_ids(target_layers: int, draft_layers: int) -> tuple[int, ...]:
    """The reference's choice when a config names none: the middle layer for one draft layer, else evenly from
    1 to L-3."""
    if draft_layers == 1:
        return (target_layers // 2,)
    span = target_layers - 4
    return tuple(round(1 + i * span / (draft_layers - 1)) for i in range(draft_layers))


def our_tensors(weights: FolderWeights, folder: Path, own_prefixes: tuple[str, ...] = (),
                what: str = "DFlash drafter", unread: frozenset[str] = SHARED_COPIES) -> dict[str, torch.Tensor]:
    """Every stored tensor under our module's names (k/v and gate/up stacked); names under `own_prefixes` (a
    DSpark drafter's heads) are ours as stored."""
    ours: dict[str, torch.Tensor] = {}
    local: dict[tuple[str, str], str] = {}  # (layer index, name inside the layer) -> stored name
    for stored in sorted(weights.names()):  # FolderWeights already dropped a leading "model."
        name = next((new + stored[len(old):] for old, new in ALIASES.items() if stored.startswith(old)), stored)
        if name in unread:
            continue
        if name in ("fc.weight", "hidden_norm.weight", "norm.weight") or name.startswith(own_prefixes):
            ours[name] = weights.get(stored)
        elif name.startswith("layers.") and name.count(".") >= 2:
            _, index, inner = name.split(".", 2)
            local[(index, inner)] = stored
        else:
            raise SpecDecodeError(f"{folder}: unknown tensor {stored!r} for a {what}")
    for (index, inner), stored in local.items():
        if inner in LAYER_NAMES:
            ours[f"layers.{index}.{LAYER_NAMES[inner]}"] = weights.get(stored)
        elif not any(inner.startswith(part + ".") for parts in STACKED.values() for part in parts):
            raise SpecDecodeError(f"{folder}: unknown tensor {stored!r} for a {what}")
    for index in sorted({index for index, _ in local}):
        for ours_name, parts in STACKED.items():
            for kind in ("weight", "bias"):
                names = [local.get((index, f"{part}.{kind}")) for part in parts]
                if any(names) and not all(names):
                    raise SpecDecodeError(f"{folder}: layer {index} has only some of {', '.join(parts)} ({kind})")
                if all(names):
                    ours[f"layers.{index}.{ours_name}.{kind}"] = torch.cat([weights.get(n) for n in names])
    return ours


def save_dflash(model: DFlashModel, folder: Path, target: ModelConfig) -> Path:
    """Write `model` in z-lab's layout (what vLLM, SGLang and the reference read)."""
    config, layer = model.config, model.config.layer
    hf = llama_config.to_hf(layer) | {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
                          "attention_bias": layer.qkv_bias, "block_size": config.block_size,
                          "num_target_layers": target.num_layers, "layer_types": ["full_attention"] * layer.num_layers,
                          "dflash_config": {"target_layer_ids": list(config.target_layer_ids),
                                            "mask_token_id": config.mask_token_id, "block_size": config.block_size}}
    return write_drafter_folder(folder, published_tensors(model), hf, "the DFlash drafter")


def published_tensors(model: DFlashModel) -> dict[str, torch.Tensor]:
    """The model's tensors under the published names (k/v and gate/up split again); tensors outside the DFlash
    body (a DSpark drafter's heads) keep their names."""
    layer = model.config.layer
    ours = {name: t.detach().float().cpu().contiguous() for name, t in model.state_dict().items()}
    published = {name: ours.pop(name) for name in list(ours) if not name.startswith("layers.")}
    by_ours = {mine: theirs for theirs, mine in LAYER_NAMES.items()}
    kv_rows = layer.num_kv_heads * layer.head_dim
    for name, tensor in ours.items():
        _, index, inner = name.split(".", 2)
        prefix = f"layers.{index}."
        if inner.startswith("kv."):
            kind = inner.split(".")[1]
            published[prefix + f"self_attn.k_proj.{kind}"], published[prefix + f"self_attn.v_proj.{kind}"] = \
                tensor.split(kv_rows)
        elif inner.startswith("mlp.gate_up."):
            kind = inner.split(".")[2]
            gate, up = tensor.split(layer.intermediate_size)
            published[prefix + f"mlp.gate_proj.{kind}"], published[prefix + f"mlp.up_proj.{kind}"] = gate, up
        else:
            published[prefix + by_ours[inner]] = tensor
    return published
