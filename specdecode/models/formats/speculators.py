"""DFlash and DSpark drafters in vLLM's speculators layout (`speculators_model_type` "dflash" or "dspark";
`DFlashSpeculator`, `DSparkSpeculator`), as vllm-project/speculators@c05b95b writes them (models/dflash/config.py,
core.py, models/dspark/config.py, model_definitions.py, convert/dflash/converter.py) and vLLM's `update_dflash`
reads them; facts in drafter-formats.md sections 3 and 4.

config.json: the draft layers' Qwen3 config nested in `transformer_layer_config`; `aux_hidden_state_layer_ids`
index the target's hidden states as Hugging Face's `hidden_states` does (the input of layer k: z-lab's
"output of layer k" + 1, so vLLM sets `dflash_config.target_layer_ids = aux - 1`); `block_size`,
`mask_token_id`; `sliding_window_non_causal` (sliding-window layers attend both ways; full-attention layers
always do); `draft_vocab_size`; `sample_from_anchor` (every slot drafts: DeepSpec's convention, DSpark's default;
DFlash drafters must not set it, as vLLM ignores it for them). DSpark adds `markov_rank`, `markov_head_type`,
`enable_confidence_head` and `confidence_head_with_markov` (speculators' defaults: 256, vanilla, true, true).
Tensors: z-lab's names without a prefix (DSpark's heads as DeepSpec names them); speculators@c05b95b also saved
frozen copies of the target's `embed_tokens` and `lm_head`, 0.9.0 (PyPI) neither for a full-vocabulary drafter
(unread here either way). With a draft vocabulary smaller than the target's, `lm_head` holds the
target's rows of the draft tokens and `d2t` maps them back (target id = draft id + d2t[draft id], as EAGLE-3's);
a DSpark Markov head's `markov_w2` then projects onto the draft vocabulary too, while `markov_w1` stays indexed by
target ids; `t2d` only serves training.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.formats.weight_source import FolderWeights

VOCAB_MAPS = frozenset({"d2t", "t2d"})  # read by draft_vocabulary below, never loaded as parameters


def is_speculators(hf: dict) -> bool:
    return "speculators_model_type" in hf


SPECULATORS_DSPARK_DEFAULTS = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                               "confidence_head_with_markov": True}  # speculators' DSparkSpeculatorConfig


def native_form(hf: dict, folder: Path) -> dict:
    """A speculators DFlash or DSpark config.json -> the form dflash.dflash_config (and, for DSpark,
    dspark.dspark_heads) reads: the layer config with the block keys nested in `dflash_config`."""
    kind = hf.get("speculators_model_type")
    if kind == "eagle3":
        raise SpecDecodeError(f"{folder} holds a speculators EAGLE-3 head, not a block drafter: use --spec-type eagle3")
    if kind not in ("dflash", "dspark"):
        raise SpecDecodeError(f"{folder} holds a speculators {kind!r} drafter; of speculators' layouts this runtime "
                              "reads EAGLE-3, DFlash and DSpark")
    layer = hf.get("transformer_layer_config")
    aux = hf.get("aux_hidden_state_layer_ids")
    if not isinstance(layer, dict) or not isinstance(aux, list) or not all(type(i) is int for i in aux):
        raise SpecDecodeError(f"{folder}/config.json: a speculators {kind} config needs transformer_layer_config "
                              "(an object) and aux_hidden_state_layer_ids (a list of layer ids)")
    every_slot_drafts = hf.get("sample_from_anchor", kind == "dspark")
    if kind == "dflash" and every_slot_drafts:
        raise SpecDecodeError(f"{folder}: sample_from_anchor (every slot drafting) is not read for a DFlash drafter, "
                              "as vLLM does not read it either; a drafter trained that way drafts in DeepSpec's "
                              "convention")
    if kind == "dspark" and not every_slot_drafts:
        raise SpecDecodeError(f"{folder}: a DSpark drafter trained with sample_from_anchor false (slot 0 drafting "
                              "nothing) is not read here; DSpark drafts with every slot")
    block = {"target_layer_ids": [i - 1 for i in aux], "mask_token_id": hf.get("mask_token_id"),
             "block_size": hf.get("block_size", 8)}
    if hf.get("sliding_window_non_causal"):
        block["causal"] = False  # else the z-lab rule is speculators' too: sliding layers causal, full ones not
    if kind == "dspark":
        block |= {name: hf.get(name, default) for name, default in SPECULATORS_DSPARK_DEFAULTS.items()}
    return {**layer, "dflash_config": block}


def draft_vocabulary(folder: Path, target_vocab: int, hidden: int) -> tuple[torch.Tensor, nn.Linear] | None:
    """(the target ids of the draft vocabulary [Vd] long, an output layer of their rows [Vd, H]) when the folder's
    drafter drafts over fewer tokens than the target has (a `d2t` table), else None (the target's head is used)."""
    weights = FolderWeights(sorted(folder.glob("*.safetensors")))
    if "d2t" not in weights.names():
        return None
    offsets = weights.get("d2t").long()  # [Vd]
    ids = torch.arange(len(offsets)) + offsets  # [Vd]
    rows = weights.get("lm_head.weight") if "lm_head.weight" in weights.names() else None  # [Vd, H]
    if rows is None or tuple(rows.shape) != (len(ids), hidden):
        raise SpecDecodeError(f"{folder}: d2t maps {len(ids)} draft tokens but lm_head "
                              f"{'is missing' if rows is None else f'has shape {tuple(rows.shape)}'}")
    if ids.min() < 0 or ids.max() >= target_vocab or len(ids.unique()) != len(ids):
        raise SpecDecodeError(f"{folder}: d2t maps draft tokens outside the target's {target_vocab} or onto one "
                              "token twice: it was made for another target")
    head = nn.Linear(hidden, len(ids), bias=False)
    head.weight = nn.Parameter(rows.float(), requires_grad=False)
    return ids, head
