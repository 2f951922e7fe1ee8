"""A Gemma 4 assistant -> families/gemma4/assistant.py's module, checked against the target it drafts for. From a folder
in transformers' layout (config.json of model_type gemma4_assistant with a text_config, and safetensors), or a GGUF
file in llama.cpp's `gemma4-assistant` layout (its converter's Gemma4AssistantModel: the gemma4 metadata under
that architecture, `embedding_length_out` for the target's hidden size, `nextn.pre_projection` and
`nextn.post_projection`, the layers as gemma4's; its converter drops the centroid head, so such a file drafts
through the full output head unless it carries `masked_embd_centroids` and `masked_embd_ordering`).

Stored names (without "model."): layers.N.* (queries, output, norms, MLP, layer_scalar: every layer reads the
target's keys and values), norm, embed_tokens (the output head, tied) or lm_head, pre_projection,
post_projection, and with ordered embeddings masked_embedding.{centroids.weight, token_ordering}.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.families.gemma4.config import from_hf, layer_shape, slot_shape
from specdecode.models.families.gemma4.tensors import layer_sources
from specdecode.models.formats.drafter_folder import load_checked, read_drafter_config
from specdecode.models.formats.weight_source import FolderWeights, stacked
from specdecode.models.model_config import ModelConfig

WHAT = "a Gemma 4 assistant"


GGUF_ARCHITECTURE = "gemma4-assistant"
_GGUF_NAMES = {"nextn.pre_projection.weight": "pre_projection.weight",
               "nextn.post_projection.weight": "post_projection.weight",
               "masked_embd_centroids.weight": "masked_embedding.centroids.weight",
               "masked_embd_ordering": "masked_embedding.token_ordering"}  # no ".weight" in llama.cpp's name


def is_assistant_folder(path: Path) -> bool:
    """Whether `path` is a Gemma 4 assistant: a folder whose config.json says gemma4_assistant, or a GGUF file of
    llama.cpp's gemma4-assistant architecture."""
    if path.is_file() and path.suffix.lower() == ".gguf":
        from specdecode.models.formats.gguf_header import read_header

        try:
            return read_header(path).metadata.get("general.architecture") == GGUF_ARCHITECTURE
        except SpecDecodeError:
            return False
    if not (path / "config.json").is_file():
        return False
    try:
        return read_drafter_config(path, WHAT).get("model_type") == "gemma4_assistant"
    except SpecDecodeError:
        return False


def assistant_config(hf: dict) -> ModelConfig:
    """The assistant's own config: its text_config, every layer reading keys and values from outside."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise SpecDecodeError(f"{WHAT}'s config.json needs a text_config")
    text = {**text, "model_type": "gemma4_text", "num_kv_shared_layers": text.get("num_hidden_layers")}
    return from_hf({"tie_word_embeddings": hf.get("tie_word_embeddings", True)} | text, "gemma4_text")


def load_assistant(folder: Path, target: ModelConfig, dtype: torch.dtype, device: torch.device, quant: str):
    """-> (GemmaAssistant in `dtype` on `device`, its linear layers in `quant` (--draft-quant), a line saying what
    was loaded). One error where it was made for another target."""
    from specdecode.models.families.gemma4.assistant import GemmaAssistant
    from specdecode.models.kernels.quantize_module import quantize_linears

    if folder.is_file():
        hf, config, weights = _gguf_source(folder)
    else:
        hf = read_drafter_config(folder, WHAT)
        config = assistant_config(hf)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise SpecDecodeError(f"{folder}: {WHAT} folder needs its *.safetensors weights")
        weights = FolderWeights(files)
    _check_fits(folder, hf, config, target)
    centroids = hf.get("num_centroids", 2048) if hf.get("use_ordered_embeddings") else 0
    model = GemmaAssistant(config, target.hidden_size, centroids, hf.get("centroid_intermediate_top_k", 32))
    load_checked(model, _state(weights, config, centroids), folder, "assistant")
    model.to(dtype=dtype, device=device).requires_grad_(False)
    # The centroid head gathers rows of the output head: that one stays float.
    quantized = sum(quantize_linears(part, quant) for part in (model.layers, model.pre_projection,
                                                                 model.post_projection))
    if not centroids:
        quantized += quantize_linears(model.lm_head, quant)
    model.read_cache_of(slot_shape(target))
    model.finish_loading()
    head = f"a centroid head ({centroids} clusters, top {model.top_clusters})" if centroids else "its full output head"
    return model.eval(), (f"Gemma 4 assistant {folder.name}: {config.num_layers} layers of width {config.hidden_size}, "
                          f"{head}" + (f", {quantized} layers in {quant}" if quantized else ""))


class _Tensors(dict):
    """A GGUF file's tensors under Hugging Face names, read as FolderWeights is."""

    def names(self) -> set[str]:
        return set(self)


def _gguf_source(path: Path) -> tuple[dict, ModelConfig, _Tensors]:
    """-> (the assistant's top-level settings as transformers names them, its config, its tensors in float32)."""
    from specdecode.models.families.gemma4.gguf import gemma4_config, gemma4_hf_name
    from specdecode.models.formats.gguf_read import dequantize_tensor, field_value, open_gguf

    reader = open_gguf(path)
    if field_value(reader, "general.architecture") != GGUF_ARCHITECTURE:
        raise SpecDecodeError(f"{path} is not {WHAT} (its architecture is not {GGUF_ARCHITECTURE})")

    def meta(key, default=None):
        return field_value(reader, f"{GGUF_ARCHITECTURE}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    try:
        config = gemma4_config(meta, tensors, None, None)
        hf = {"backbone_hidden_size": int(meta("embedding_length_out")),
              "use_ordered_embeddings": "masked_embd_centroids.weight" in tensors}
    except (KeyError, TypeError, ValueError) as error:
        raise SpecDecodeError(f"{path}: GGUF metadata is missing or malformed ({error!r})") from None
    if hf["use_ordered_embeddings"]:
        hf["num_centroids"] = int(tensors["masked_embd_centroids.weight"].shape[1])
    weights = _Tensors()
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight":
            continue  # the full layers' rope, read into the config
        ours = _GGUF_NAMES.get(name) or gemma4_hf_name(name).removeprefix("model.")
        weights[ours] = torch.from_numpy(dequantize_tensor(tensor))
    return hf, config, weights


def _state(weights: FolderWeights | _Tensors, config: ModelConfig, centroids: int) -> dict[str, torch.Tensor]:
    names = weights.names()
    sources = {"pre_projection.weight": ["pre_projection.weight"], "post_projection.weight": ["post_projection.weight"],
               "norm.weight": ["norm.weight"],
               "lm_head.weight": ["lm_head.weight" if "lm_head.weight" in names else "embed_tokens.weight"]}
    for i in range(config.num_layers):
        sources.update(layer_sources(f"layers.{i}.", f"layers.{i}.", config, i, ple=False))
    if centroids:
        sources.update({"centroids.weight": ["masked_embedding.centroids.weight"],
                        "token_ordering": ["masked_embedding.token_ordering"]})
    missing = sorted(name for parts in sources.values() for name in parts if name not in names)
    if missing:
        raise SpecDecodeError(f"{WHAT} lacks {', '.join(missing[:3])}")
    state = {ours: stacked(weights, theirs) for ours, theirs in sources.items()}
    if "token_ordering" in state:
        state["token_ordering"] = state["token_ordering"].long()
    return state


def _check_fits(folder: Path, hf: dict, config: ModelConfig, target: ModelConfig) -> None:
    """The assistant reads the target's hidden state, embedding and KV cache: their sizes must be its own."""
    if target.architecture != "gemma4":
        raise SpecDecodeError(f"{folder} is {WHAT}: it drafts for a Gemma 4 target, not {target.architecture}")
    differing = []
    if hf.get("backbone_hidden_size", 1536) != target.hidden_size:
        differing.append(f"backbone_hidden_size {hf.get('backbone_hidden_size', 1536)} against the target's hidden "
                         f"size {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        differing.append(f"vocabulary {config.vocab_size} against {target.vocab_size}")
    for kind in sorted(set(config.layer_types)):
        if layer_shape(config, kind) != layer_shape(target, kind):
            differing.append(f"{kind} layers' (KV heads, head size) {layer_shape(config, kind)} against "
                             f"{layer_shape(target, kind)}")
    if config.num_heads % layer_shape(target, "full_attention")[0] or config.num_heads % target.num_kv_heads:
        differing.append(f"{config.num_heads} query heads do not group over the target's KV heads")
    if differing:
        raise SpecDecodeError(f"{folder} is {WHAT} for another model: {'; '.join(differing)}")
