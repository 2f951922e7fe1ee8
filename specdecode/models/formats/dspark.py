"""DSpark drafters as DeepSpec saves them (`Qwen3DSparkModel`, drafter-formats.md section 4), read into our
DSparkModel, and ours written the same way.

config.json: the target's config plus `target_layer_ids` (top level, "output of layer k", -1 for the embedding),
`mask_token_id`, `block_size`, `num_target_layers`, `markov_rank` (0: none), `markov_head_type`
(vanilla | gated | rnn), `enable_confidence_head`, `confidence_head_with_markov`; the nested `dflash_config`
form vLLM converts to is read too (it wins, as DFlash's rule). Tensors: the DFlash body (dflash.py)
plus `markov_head.{markov_w1, markov_w2, gate_proj, joint_proj}` and `confidence_head.proj`. DeepSpec also
stores frozen copies of the target's `embed_tokens` and `lm_head`: the target's own are used (as vLLM does when
they are absent), so our save leaves them out. A reduced draft vocabulary (`d2t` with `lm_head`'s rows of it, and
`markov_w2` over it) is read as vLLM reads it. vLLM's speculators layout is translated on the way in
(speculators.py).
"""

from __future__ import annotations

from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder import llama_config
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.formats.dflash import SHARED_COPIES, block_drafter_config, dflash_config, fill, published_tensors
from specdecode.models.formats.drafter_folder import write_drafter_folder
from specdecode.models.formats.speculators import VOCAB_MAPS, draft_vocabulary
from specdecode.models.heads.dspark import MARKOV_KINDS, DSparkHeads, DSparkModel
from specdecode.models.model_config import ModelConfig

HEAD_PREFIXES = ("markov_head.", "confidence_head.")


def load_dspark(path: str | Path, target: Transformer, max_positions: int) -> tuple[DSparkModel, str]:
    """The drafter in folder `path`, checked against `target`, in its dtype and device -> (model, one line)."""
    folder = Path(path)
    hf, layout = block_drafter_config(folder, "dspark")
    config = dflash_config(hf, target.config, folder)
    heads = dspark_heads(hf, folder)
    vocabulary = draft_vocabulary(folder, target.config.vocab_size, config.layer.hidden_size)
    model = DSparkModel(config, heads, target.embed, target.lm_head,
                        draft_vocab=len(vocabulary[0]) if vocabulary is not None else None)
    fill(model, folder, target, max_positions, HEAD_PREFIXES, "DSpark drafter", SHARED_COPIES | VOCAB_MAPS)
    if vocabulary is not None:
        model.use_draft_vocabulary(*vocabulary)
    markov = f"{heads.markov_kind} Markov head of rank {heads.markov_rank}" if heads.markov_rank else "no Markov head"
    confidence = "a confidence head" if heads.confidence else "no confidence head"
    vocab = f", a {len(vocabulary[0])}-token draft vocabulary" if vocabulary is not None else ""
    return model, (f"DSpark drafter {folder.name} ({layout} layout, {config.layer.num_layers} layers, block "
                   f"{config.block_size}, {markov}, {confidence}{vocab})")


def dspark_heads(hf: dict, folder: Path) -> DSparkHeads:
    nested = hf.get("dflash_config") or {}

    def value(name: str, default):
        return nested.get(name, hf.get(name, default))

    try:
        rank = int(value("markov_rank", 0))
        kind = str(value("markov_head_type", "vanilla")).lower()
        confidence = bool(value("enable_confidence_head", False))
        with_markov = bool(value("confidence_head_with_markov", False))
    except (TypeError, ValueError) as error:
        raise SpecDecodeError(f"{folder}/config.json has a malformed DSpark field ({error})") from None
    if rank < 0 or kind not in MARKOV_KINDS:
        raise SpecDecodeError(f"{folder}/config.json: markov_rank must be >= 0 and markov_head_type one of "
                              f"{', '.join(MARKOV_KINDS)}, got {rank} and {kind!r}")
    if confidence and with_markov and not rank:
        raise SpecDecodeError(f"{folder}/config.json: confidence_head_with_markov needs a Markov head "
                              "(markov_rank > 0)")
    return DSparkHeads(markov_rank=rank, markov_kind=kind, confidence=confidence, confidence_with_markov=with_markov)


def save_dspark(model: DSparkModel, folder: Path, target: ModelConfig, anchors: int) -> Path:
    """Write `model` in DeepSpec's layout (what vLLM's `dspark` method reads)."""
    config, layer, heads = model.config, model.config.layer, model.heads
    hf = llama_config.to_hf(layer) | {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
                          "attention_bias": layer.qkv_bias, "tie_word_embeddings": False,
                          "block_size": config.block_size, "num_target_layers": target.num_layers,
                          "layer_types": ["full_attention"] * layer.num_layers,
                          "target_layer_ids": list(config.target_layer_ids), "mask_token_id": config.mask_token_id,
                          "num_anchors": anchors, "markov_rank": heads.markov_rank,
                          "markov_head_type": heads.markov_kind, "enable_confidence_head": heads.confidence,
                          "confidence_head_with_markov": heads.confidence_with_markov}
    return write_drafter_folder(folder, published_tensors(model), hf, "the DSpark drafter")
