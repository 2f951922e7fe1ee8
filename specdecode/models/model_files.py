"""A model's files read through its family (families/): a GGUF file's config and tensors, the parameters a config
needs and the shapes it implies, checked against what the weights hold before anything is allocated, and the MTP
layers of a companion file. The readers themselves (formats/) know no family."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.mtp import MTPModule
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.families.registry import family_for_gguf, family_of, unsupported_message
from specdecode.models.formats.gguf_read import field_value, open_gguf
from specdecode.models.formats.mtp_companion import MATCHING_FIELDS, companion_layers
from specdecode.models.formats.weight_source import FolderWeights, GGUFWeights
from specdecode.models.kernels.quantize_module import quantize_linears
from specdecode.models.model_config import ModelConfig

Weights = FolderWeights | GGUFWeights
_ALWAYS_HARMLESS = {"lm_head.weight", "rope_freqs"}  # a tied head stored anyway; llama3 rope factors
_TRUNK_COPIES = {"embed_tokens.weight", "norm.weight", "lm_head.weight", "rope_freqs"}  # what a companion repeats


def parameter_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Each of our parameter names -> the Hugging Face names (without "model.") stacked into it, in order."""
    return family_of(config).sources(config)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name (without "model.") -> the shape the config implies for it."""
    return family_of(config).shapes(config)


def parameter_count(config: ModelConfig) -> int:
    """Weights the architecture holds, from its sizes (a quantized model's buffers would miscount them)."""
    return family_of(config).parameter_count(config)


def gguf_config(reader, path: Path, companion: bool = False) -> ModelConfig:
    """The config a GGUF file's metadata states, read by the family of its architecture; `companion`: the file may
    hold MTP layers alone (llama.cpp's --mtp companion)."""
    architecture = field_value(reader, "general.architecture")
    family = family_for_gguf(architecture)
    if family is None:
        raise SpecDecodeError(f"{path}: {unsupported_message(architecture)}")

    def meta(key, default=None):
        return field_value(reader, f"{architecture}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    tokens = {"bos": field_value(reader, "tokenizer.ggml.bos_token_id"),
              "eos": field_value(reader, "tokenizer.ggml.eos_token_id")}
    try:
        return family.config_from_gguf(meta, architecture, tensors, tokens, path, companion)
    except (KeyError, TypeError, ValueError, ArithmeticError) as error:  # a zero head count divides by zero
        raise SpecDecodeError(f"{path}: GGUF metadata is missing or malformed ({error!r})") from None


def open_gguf_weights(path: Path, companion: bool = False) -> GGUFWeights:
    """A GGUF file's tensors under Hugging Face names and values, as its family's layout says to read them."""
    reader = open_gguf(path)
    config = gguf_config(reader, path, companion)
    layout = family_of(config).gguf_layout(config, field_value(reader, "general.architecture"))
    return GGUFWeights(reader, config, layout)


def with_present_mtp(config: ModelConfig, weights: Weights) -> ModelConfig:
    """The config with as many MTP modules as `weights` hold (a conversion may have dropped them)."""
    return replace(config, mtp_layers=mtp_tensors_present(weights.names(), config))


def mtp_tensors_present(names: set[str], config: ModelConfig) -> int:
    """How many of the MTP modules the config declares the weight names `names` (without "model.") hold: all
    of them or none (a conversion that dropped them); a part of them is one clear error."""
    if not config.mtp_declared:
        return 0
    wanted = family_of(config).mtp_names(config)
    found = wanted & names
    if found and found != wanted:
        raise SpecDecodeError(f"the weights hold only part of the {config.mtp_declared} MTP layers the config "
                              f"declares; missing {', '.join(sorted(wanted - found)[:3])}")
    return config.mtp_declared if found else 0


def matching_sources(weights: Weights, where: Path, config: ModelConfig) -> dict[str, list[str]]:
    """parameter_sources(config) once the weights are known to fit it: the same layers, every needed tensor
    present with the shape the config implies, none left over. Otherwise one message naming what differs, before
    anything is allocated (a config whose sizes disagree with its weights would fail deep in PyTorch)."""
    family = family_of(config)
    available = weights.names()
    # First, and from the names alone: a config's depth far off its weights' (a typo of a billion layers) must not
    # make the maps of every layer it claims.
    layers = {int(part) for name in available if name.startswith("layers.") and (part := name.split(".")[1]).isdigit()}
    if config.mtp_layout == "deepseek":  # DeepSeek numbers its MTP modules after the trunk's layers
        layers -= set(range(config.num_layers, config.num_layers + config.mtp_declared))
    if layers and len(layers) != config.num_layers:  # Hugging Face's naming (a family may have its own)
        raise SpecDecodeError(f"{where}: the config says {config.num_layers} layers but the weights hold {len(layers)}")
    sources = family.sources(config)
    needed = {name for names in sources.values() for name in names}
    missing = sorted(needed - available)
    # What the family says may sit unread (a multimodal checkpoint's vision tower) is harmless; anything else
    # unused means a different model.
    unexpected = sorted(name for name in available - needed - _ALWAYS_HARMLESS if not family.unread(config, name))
    if missing or unexpected:
        raise SpecDecodeError(
            f"{where}: weights do not match a {config.architecture} model"
            + (f"; missing {', '.join(missing[:5])}" if missing else "")
            + (f"; unexpected {', '.join(unexpected[:5])}" if unexpected else "")
        )
    expected = family.shapes(config)
    for name in sorted(needed | (available & {"rope_freqs"})):
        shape = weights.shape(name)
        if shape != expected[name]:
            raise SpecDecodeError(f"{where}: {name} has shape {list(shape)} but the config implies "
                                  f"{list(expected[name])}; config.json does not belong to these weights")
    return sources


def load_companion(path: Path, target: Transformer, quant: str) -> tuple[nn.ModuleList, str]:
    """A companion file's MTP modules (formats/mtp_companion.py), checked against the target, in its dtype and
    device, their linear layers in `quant` (--draft-quant) -> (modules, one line saying what was loaded)."""
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise SpecDecodeError(f"{path}: MTP layers of their own come as a GGUF file (llama.cpp's mtp-NAME.gguf); "
                              "MTP layers in a model folder load with the model itself")
    count = companion_layers(path)
    if not count:
        raise SpecDecodeError(f"{path} is not an MTP companion file: it holds no nextn layers, or holds a trunk "
                              "too (a model that ships its MTP layers inside is loaded as the model itself)")
    weights = open_gguf_weights(path, companion=True)  # its config: the sizes in its metadata
    target_config = target.config
    differing = [f"{name} {getattr(weights.config, name)} against the target's {getattr(target_config, name)}"
                 for name in MATCHING_FIELDS if getattr(weights.config, name) != getattr(target_config, name)]
    if differing:
        raise SpecDecodeError(f"{path} holds MTP layers for another model: {'; '.join(differing)}")
    config = replace(target_config, mtp_layers=count, mtp_declared=count, mtp_layout=weights.config.mtp_layout)
    family = family_of(config)
    sources = {ours: theirs for ours, theirs in family.sources(config).items() if ours.startswith("mtp.")}
    wanted = {name for names in sources.values() for name in names}
    held = {name for name in weights.names() if name in wanted or _mtp_only(name, config, family)}
    wrong = sorted(name for name in wanted & held if weights.shape(name) != family.shapes(config)[name])
    if held != wanted or wrong:
        raise SpecDecodeError(f"{path}: its MTP layers do not fit the target ("
                              + "; ".join(part for part in (
                                  f"missing {', '.join(sorted(wanted - held)[:3])}" if wanted - held else "",
                                  f"unexpected {', '.join(sorted(held - wanted)[:3])}" if held - wanted else "",
                                  f"wrong shape {', '.join(wrong[:3])}" if wrong else "") if part) + ")")
    state = {}
    for ours, theirs in sources.items():
        parts = [weights.get(name) for name in theirs]  # float32, in Hugging Face's row order
        state[ours.removeprefix("mtp.")] = torch.cat(parts) if len(parts) > 1 else parts[0]
    trunk = type(target)
    modules = nn.ModuleList(MTPModule(config, trunk.build_mtp_block(config), trunk.mtp_feeds_back_normed)
                            for _ in range(count))
    modules.load_state_dict(state)
    modules.to(dtype=target.dtype, device=target.device).requires_grad_(False)
    quantized = quantize_linears(modules, quant)
    description = (f"{count} MTP layer(s) from the companion file {path.name}"
                   + (f", {quantized} layers in {quant}" if quantized else ""))
    return modules, description


def _mtp_only(name: str, config: ModelConfig, family) -> bool:
    """Whether a companion's tensor `name` belongs to its MTP layers: anything but the copies of the trunk's
    embedding, final norm, head and rope factors it carries (the target's are used) and what the family leaves
    unread."""
    return name not in _TRUNK_COPIES and not family.unread(config, name)
