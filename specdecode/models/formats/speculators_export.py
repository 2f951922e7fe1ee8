"""Our trained drafters written in vLLM's speculators layout, the one its own classes load (speculators 0.9.0,
PyPI: `Eagle3DraftModel`, `DFlashDraftModel`, `DSparkDraftModel`, through `SpeculatorModel.from_pretrained`)
and vLLM reads as a speculators checkpoint. tests/fixtures/speculators_oracle/make_fixtures.py loads our files
with those classes and commits their logits; tests/training/test_speculators_exports.py matches ours to them.

config.json: `speculators_model_type`, the draft layers' Hugging Face config nested in
`transformer_layer_config` (RoPE written both ways: `rope_theta`/`rope_scaling` for transformers 4,
`rope_parameters` for transformers 5), `draft_vocab_size`, the target layers read in vLLM's boundary ids
(`eagle_aux_hidden_state_layer_ids`; DFlash and DSpark: `aux_hidden_state_layer_ids`, z-lab's id + 1), and
`speculators_config` {algorithm, a greedy proposal, the verifier's name and architectures}. speculators'
`from_pretrained` reads the verifier's embedding, head and final norm from `verifier.name_or_path`, which is
the --target as given (a Hugging Face id or folder); none of them is written here (vLLM shares the target's).
Tensors: EAGLE-3's under `layers.0.*` (speculators renamed the reference's `midlayer.`), `fc`, `norm`,
`lm_head` and, with a reduced draft vocabulary, `d2t` offsets and the `t2d` mask; DFlash's and DSpark's as
z-lab and DeepSpec name them (speculators keeps those names), with no `lm_head` over the full vocabulary.
The deprecated `Eagle3Speculator` class (loaded with `verifier_attachment_mode="detached"`) is not a target:
since speculators 0.5 it survives only in the converter, and its forward raises NotImplementedError.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdecode.models.formats.dflash import published_tensors as block_tensors
from specdecode.models.formats.drafter_folder import write_drafter_folder
from specdecode.models.formats.eagle3 import published_tensors as eagle3_tensors
from specdecode.models.heads.dflash import DFlashModel
from specdecode.models.heads.dspark import DSparkModel
from specdecode.models.heads.eagle3 import Eagle3Head
from specdecode.models.model_config import ModelConfig

SPECULATORS_VERSION = "0.9.0"  # the release whose classes were run on our files (the oracle fixtures)


@dataclass(frozen=True)
class Verifier:
    """The target as speculators_config records it."""

    name_or_path: str  # the --target as given
    architectures: list[str]  # its config.json's, as transformers reads it (families.config_to_hf)


def save_eagle3_speculators(head: Eagle3Head, folder: Path, verifier: Verifier) -> Path:
    """`head` as speculators' Eagle3DraftModel saves one; `verifier`: the target, for speculators_config."""
    config, layer = head.config, head.config.layer
    tensors = eagle3_tensors(head, "layers.0.")
    if config.draft_vocab_size == layer.vocab_size:  # speculators keeps the maps only for a reduced vocabulary
        del tensors["d2t"], tensors["t2d"]
    hf = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
          "speculators_version": SPECULATORS_VERSION,
          "transformer_layer_config": layer_config(layer, "qwen3" if layer.qk_norm else "llama", 1),
          "draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.target_hidden_size,
          "eagle_aux_hidden_state_layer_ids": list(config.layer_ids),
          "norm_before_residual": config.norm_before_residual, "norm_before_fc": False, "fc_norm": False,
          "norm_output": config.norm_output, "embed_requires_grad": False, "tie_word_embeddings": False,
          "speculators_config": speculators_config("eagle3", 3, verifier), "dtype": "float32"}
    return write_drafter_folder(folder, tensors, hf, "the head")


def save_block_speculators(model: DFlashModel, folder: Path, verifier: Verifier) -> Path:
    """A DFlash drafter (or a DSparkModel, DFlash's body with its heads) as speculators saves one."""
    config, layer = model.config, model.config.layer
    dspark = isinstance(model, DSparkModel)
    # DFlash drafts slots 1..B-1 of a block (the anchor is the last committed token); DSpark drafts every slot.
    drafted = config.block_size if dspark else config.block_size - 1
    hf = {"architectures": ["DSparkDraftModel" if dspark else "DFlashDraftModel"],
          "speculators_model_type": "dspark" if dspark else "dflash", "speculators_version": SPECULATORS_VERSION,
          "transformer_layer_config": layer_config(layer, "qwen3", layer.num_layers),
          "draft_vocab_size": layer.vocab_size, "block_size": config.block_size,
          "target_hidden_size": config.target_hidden_size,
          "aux_hidden_state_layer_ids": list(config.boundary_ids), "mask_token_id": config.mask_token_id,
          "sliding_window_non_causal": False, "sample_from_anchor": dspark, "tie_word_embeddings": False,
          "speculators_config": speculators_config("dspark" if dspark else "dflash", drafted, verifier),
          "dtype": "float32"}
    if dspark:
        heads = model.heads
        hf |= {"markov_rank": heads.markov_rank, "markov_head_type": heads.markov_kind,
               "enable_confidence_head": heads.confidence, "confidence_head_with_markov": heads.confidence_with_markov}
    return write_drafter_folder(folder, block_tensors(model), hf, "the drafter")


def layer_config(layer: ModelConfig, model_type: str, layers: int) -> dict:
    """The draft layers' Hugging Face config, RoPE in both transformers' forms."""
    rope = {"rope_type": "default", **(layer.rope_scaling or {}), "rope_theta": layer.rope_theta}
    return {"model_type": model_type, "vocab_size": layer.vocab_size, "hidden_size": layer.hidden_size,
            "intermediate_size": layer.intermediate_size, "num_hidden_layers": layers,
            "num_attention_heads": layer.num_heads, "num_key_value_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim, "rms_norm_eps": layer.rms_norm_eps, "hidden_act": "silu",
            "rope_theta": layer.rope_theta, "rope_scaling": layer.rope_scaling, "rope_parameters": rope,
            "max_position_embeddings": layer.max_position_embeddings, "attention_bias": layer.qkv_bias,
            "mlp_bias": layer.mlp_bias, "tie_word_embeddings": False, "layer_types": ["full_attention"] * layers}


def speculators_config(algorithm: str, drafted: int, verifier: Verifier) -> dict:
    """The proposal (greedy, `drafted` tokens a step) and the verifier speculators records."""
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": drafted, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier.name_or_path, "architectures": verifier.architectures}}
