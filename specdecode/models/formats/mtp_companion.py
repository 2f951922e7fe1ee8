"""MTP layers in a GGUF file of their own, beside a main file that has none: llama.cpp's companion layout.

llama.cpp's converter can publish a model as two files (`convert_hf_to_gguf.py --no-mtp`, then `--mtp`): the
trunk alone (block_count L, no `{arch}.nextn_predict_layers`), and `mtp-NAME.gguf`, which holds only the MTP
layers and what they need. That companion has the trunk's `general.architecture`, block_count L+n and
`{arch}.nextn_predict_layers` n, the layers at `blk.{L+j}.*` (nextn.* plus an ordinary block), its own copies of
`token_embd`, `output_norm` and `output`, and the tokenizer; nothing marks it but its name and the missing
`blk.0.*` (llama.cpp's loaders tell it by that; its download code pairs files whose names hold "mtp-").
drafter-formats.md and the #14 notes give the sources.

Here the companion's MTP layers join the target's as the `mtp` drafter's own modules. Its copies of the
embedding and head are read only for their shapes: as with DeepSeek's shared copies, the target's are used.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.formats.gguf_header import read_header
from specdecode.models.model_config import ModelConfig

COMPANION_MARK = "mtp-"  # what llama.cpp's download code looks for in a companion's file name
# The sizes a companion's metadata states, which must be the target's (num_layers: the trunk before the MTP layers).
_MATCHING_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim")


def companion_beside(gguf_file: Path) -> Path | None:
    """The MTP companion of `gguf_file` in its folder, from headers alone: a file whose name holds "mtp-", with
    the same architecture and trunk depth, holding MTP layers and no trunk; None when there is none."""
    try:
        main = read_header(gguf_file).metadata
    except SpecDecodeError:
        return None
    arch = main.get("general.architecture")
    trunk = int(main.get(f"{arch}.block_count", 0)) - int(main.get(f"{arch}.nextn_predict_layers", 0))
    for candidate in sorted(gguf_file.parent.glob("*.gguf")):
        if candidate == gguf_file or COMPANION_MARK not in candidate.name.lower():
            continue
        try:
            header = read_header(candidate)
        except SpecDecodeError:
            continue  # an unreadable neighbour is not ours to judge; loading it by name says what is wrong
        layers = _companion_layers(header.metadata, header.types)
        if header.metadata.get("general.architecture") == arch and layers and \
                int(header.metadata[f"{arch}.block_count"]) - layers == trunk:
            return candidate
    return None


def companion_layers(path: Path) -> int:
    """How many MTP layers the GGUF file `path` holds as a companion, from its header (0: not a companion)."""
    header = read_header(path)
    return _companion_layers(header.metadata, header.types)


def _companion_layers(metadata: dict, types: dict) -> int:
    """How many MTP layers a file holds as a companion (its nextn blocks present, no trunk block 0), else 0."""
    arch = metadata.get("general.architecture")
    count = int(metadata.get(f"{arch}.nextn_predict_layers", 0))
    trunk = int(metadata.get(f"{arch}.block_count", 0)) - count
    present = all(f"blk.{trunk + j}.nextn.eh_proj.weight" in types for j in range(count))
    return count if count and present and "blk.0.attn_norm.weight" not in types else 0


def _layer_sources(weights, config: ModelConfig, j: int) -> tuple[dict[str, list[str]], set[str]]:
    """MTP layer j's parameters (ours -> the stored names stacked into each), and the names the file holds for
    that layer (the embedding and head copies left out: the target's are used)."""
    from specdecode.models.formats.hybrid_names import hybrid_sources
    from specdecode.models.formats.weight_source import MTP_SHARED_COPIES, mtp_sources

    if config.is_hybrid:  # one module, mtp.{fc, norms, layers.j}: the fc and norms belong to module 0
        sources = {ours: theirs for ours, theirs in hybrid_sources(config).items() if ours.startswith(f"mtp.{j}.")}
        parts = {f"mtp.{name}" for name in ("fc.weight", "pre_fc_norm_embedding.weight",
                                             "pre_fc_norm_hidden.weight", "norm.weight")}
        held = {name for name in weights.names() if name.startswith(f"mtp.layers.{j}.") or name in parts}
        return sources, held
    layer = f"layers.{config.num_layers + j}."
    held = {name for name in weights.names() if name.startswith(layer)}
    return mtp_sources(j, config), held - {layer + copy for copy in MTP_SHARED_COPIES}


def load_companion(path: Path, target_config: ModelConfig, dtype: torch.dtype, device: torch.device,
                   quant: str) -> tuple[nn.ModuleList, str]:
    """The companion's MTP modules, checked against the target's config, in its dtype and device, their linear
    layers in `quant` (--draft-quant) -> (modules, one line saying what was loaded)."""
    from specdecode.models.decoder.mtp import MTPModule
    from specdecode.models.formats.hybrid_names import hybrid_shapes
    from specdecode.models.formats.weight_source import GGUFWeights, expected_shapes
    from specdecode.models.kernels.quantize_module import quantize_linears

    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise SpecDecodeError(f"{path}: MTP layers of their own come as a GGUF file (llama.cpp's mtp-NAME.gguf); "
                              "MTP layers in a model folder load with the model itself")
    count = companion_layers(path)
    if not count:
        raise SpecDecodeError(f"{path} is not an MTP companion file: it holds no nextn layers, or holds a trunk "
                              "too (a model that ships its MTP layers inside is loaded as the model itself)")
    weights = GGUFWeights(path, companion=True)  # its config: the sizes in its metadata
    differing = [f"{name} {getattr(weights.config, name)} against the target's {getattr(target_config, name)}"
                 for name in _MATCHING_FIELDS if getattr(weights.config, name) != getattr(target_config, name)]
    if differing:
        raise SpecDecodeError(f"{path} holds MTP layers for another model: {'; '.join(differing)}")
    # Qwen 3.5's (qwen35) layers are its own top-level MTP module; the others are DeepSeek's blocks L + j.
    layout = target_config.mtp_layout if target_config.is_hybrid else "deepseek"
    config = replace(target_config, mtp_layers=count, mtp_declared=count, mtp_layout=layout)
    shapes = hybrid_shapes(config) if config.is_hybrid else expected_shapes(config)
    state: dict[str, torch.Tensor] = {}
    for j in range(count):
        sources, held = _layer_sources(weights, config, j)
        wanted = {name for names in sources.values() for name in names}
        wrong = sorted(name for name in wanted & held if weights.shape(name) != shapes[name])
        if held != wanted or wrong:
            raise SpecDecodeError(f"{path}: MTP layer {j} does not fit the target ("
                                  + "; ".join(part for part in (
                                      f"missing {', '.join(sorted(wanted - held)[:3])}" if wanted - held else "",
                                      f"unexpected {', '.join(sorted(held - wanted)[:3])}" if held - wanted else "",
                                      f"wrong shape {', '.join(wrong[:3])}" if wrong else "") if part) + ")")
        for ours, theirs in sources.items():
            parts = [weights.get(name) for name in theirs]  # float32, q/k rows in Hugging Face order
            state[ours.removeprefix("mtp.")] = torch.cat(parts) if len(parts) > 1 else parts[0]
    modules = nn.ModuleList(MTPModule(config) for _ in range(count))
    modules.load_state_dict(state)
    modules.to(dtype=dtype, device=device).requires_grad_(False)
    quantized = quantize_linears(modules, quant)
    description = (f"{count} MTP layer(s) from the companion file {path.name}"
                   + (f", {quantized} layers in {quant}" if quantized else ""))
    return modules, description
