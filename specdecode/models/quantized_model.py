"""A weight-only quantized model, built straight from its source one layer at a time, and cached.

Building reads a block of rows at a time, quantizes it and lets the float copy go, so memory holds the
quantized model plus one block of rows in float32 (the 1.5B's peak is measured in docs/benchmarks/README.md).
The result is saved in the kernels' own packed layout, so later starts only read a file; a mixture of experts'
experts are not even read then, but mapped (read_quantized).

Which format each linear layer gets:
- int8: every layer, per output channel.
- int4: every layer, in groups. From a GGUF file, Q4_K tensors become int4 groups of 32 exactly (no
  requantization); tensors stored in other types (Q5_0, Q6_K, Q8_0, F16) are requantized from their
  dequantized values. A Q4_K_M file keeps some tensors at 6 bits on purpose; here they go to 4 bits too,
  because on CPU the int8 kernel streams weights at about 2/3 the speed of the int4 one and costs 2-4x more
  for 4-8 rows (measured in docs/benchmarks/README.md), which made the 1.5B target 26% slower per token.
  A layer the int4 kernel cannot tile (outputs not a multiple of 16, inputs not of the group size) is int8.
- w4a8: the int4 weights above (groups of 32) for w4a8_linear.py's kernel, which also rounds activations;
  scales and offsets are re-rounded to 8-bit codes (the file's Q4_K codes stay exact).
- w3a8: the decoder layers at 3 bits per group of 32 on the same kernel, each group's range searched for the
  least squared error (from the float values: a GGUF's tensors are dequantized first), the output head as in
  w4a8, as llama.cpp's 3-bit files keep theirs wider: on the default draft a 3-bit head as well lost 3 more
  points of acceptance (74.8% against 77.6%) for about the same speed (docs/benchmarks). For draft models.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.families.registry import family_of
from specdecode.models.formats.atomic_folder import write_folder_atomically
from specdecode.models.formats.default_models import cache_dir
from specdecode.models.formats.gguf_int4 import Q4_K_GROUP
from specdecode.models.formats.safetensors_read import read_tensors
from specdecode.models.formats.weight_source import FolderWeights, GGUFWeights, row_blocks, stacked_as
from specdecode.models.heap import free_large_blocks_promptly
from specdecode.models.kernels.quantize_module import quantized_from_rows
from specdecode.models.kernels.quantized_linear import Int4Linear, Int8Linear
from specdecode.models.kernels.w4a8_linear import W4A8Linear, load_kernel
from specdecode.models.model_config import ModelConfig
from specdecode.models.model_files import matching_sources

# Bump when the saved layout changes; the packed int4 layout belongs to torch, so its version is in the key too.
_FORMAT = "specdecode-quantized-3"
WEIGHTS_FILE = "quantized.safetensors"
EXPERTS_PART = ".experts."  # in the names of a mixture of experts' routed experts' tensors (decoder/moe.py)


def quantized_cache_folder(source_files: list[Path], dtype: torch.dtype, quant: str, group_size: int) -> Path:
    """Keyed by the source files (path, size, mtime), dtype, mode, group size, torch version and format."""
    parts = [f"{p.resolve()}|{p.stat().st_size}|{p.stat().st_mtime_ns}" for p in source_files]
    parts += [str(dtype), quant, str(group_size), torch.__version__, _FORMAT]
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
    mode = quant if quant == "int8" else f"{quant}-g{group_size}"
    return cache_dir() / "quantized" / f"{source_files[0].stem}-{key}-{str(dtype)[6:]}-{mode}"


def load_quantized(source: FolderWeights | GGUFWeights | None, config: ModelConfig, where: Path, cache: Path,
                   dtype: torch.dtype, quant: str, group_size: int, quiet: bool,
                   write_extra: Callable[[Path], None] | None = None) -> Transformer:
    """From the cache when it holds this model (`source` may then be None), else built from `source` and then
    saved there together with whatever `write_extra(folder)` adds (a GGUF file's tokenizer)."""
    if quant in ("w4a8", "w3a8"):
        load_kernel(quiet)  # compiled now, with a message, rather than silently at the first forward
    if (cache / WEIGHTS_FILE).is_file():
        return read_quantized(cache / WEIGHTS_FILE, config, dtype)
    model = build_quantized(source, config, where, dtype, quant, group_size, quiet)
    save_quantized(model, cache, write_extra)
    return model


def build_quantized(source: FolderWeights | GGUFWeights, config: ModelConfig, where: Path, dtype: torch.dtype,
                    quant: str, group_size: int, quiet: bool = False) -> Transformer:
    sources = matching_sources(source, where, config)
    free_large_blocks_promptly()
    with torch.device("meta"):
        model = family_of(config).build(config)
    linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    floats = {name: stacked_as(source, names, dtype) for name, names in sources.items()
              if name.removesuffix(".weight") not in linears}  # norms, biases, embedding
    model.load_state_dict(floats, strict=False, assign=True)
    for name in tqdm(linears, desc=f"quantizing {where.name} to {quant}", unit="layer", disable=quiet):
        weight_names = sources.get(f"{name}.weight", sources["embed.weight"])  # a tied head quantizes the embedding
        layer_quant = "w4a8" if quant == "w3a8" and name == "lm_head" else quant
        layer = quantized_layer(source, weight_names, floats.get(f"{name}.bias"), layer_quant, group_size, dtype)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    rope_factors = source.get("rope_freqs") if "rope_freqs" in source.names() else None
    family_of(model.config).fuse_w4a8(model)
    model.finish_loading(rope_factors)
    return model.eval()


def quantized_layer(source: FolderWeights | GGUFWeights, names: list[str], bias: torch.Tensor | None, quant: str,
                    group_size: int, dtype: torch.dtype) -> nn.Module:
    """One linear layer whose weight stacks the tensors `names` along the output dimension, read a block of
    rows at a time."""
    shape = (sum(source.shape(n)[0] for n in names), source.shape(names[0])[1])  # [N, K]
    q4_k = group_size == Q4_K_GROUP and all(source.is_q4_k(n) for n in names)
    return quantized_from_rows(shape, lambda: row_blocks(source, names, source.get), bias, quant, group_size, dtype,
                               (lambda: row_blocks(source, names, source.q4_k)) if q4_k else None)


def save_quantized(model: Transformer, folder: Path, write_extra: Callable[[Path], None] | None = None) -> None:
    """Written whole or not at all, so an interrupted save is never mistaken for a cache hit."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.rope_factors is not None:
        state["rope_freqs"] = model.rope_factors

    def write(staging: Path) -> None:
        save_file(state, staging / WEIGHTS_FILE, metadata={"format": _FORMAT})
        if write_extra is not None:
            write_extra(staging)

    write_folder_atomically(folder, write)


def read_quantized(path: Path, config: ModelConfig, dtype: torch.dtype) -> Transformer:
    # Copies of their own, except the experts': those stay views into the mapped file, so pages of experts no token
    # routes to are never read into memory, and the system can drop idle ones again (a copy would pin them all).
    state = read_tensors(path, mapped=lambda name: EXPERTS_PART in name)
    with torch.device("meta"):
        model = family_of(config).build(config)
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        # Shells of the right kind and shape; load_state_dict below then checks every key.
        bias = state.get(f"{name}.bias")
        if f"{name}.block_scales" in state:
            layer = W4A8Linear(state[f"{name}.codes"], state[f"{name}.group_scales"], state[f"{name}.block_scales"],
                               bias)
        elif f"{name}.packed" in state:
            scales_and_zeros = state[f"{name}.scales_and_zeros"]  # [K/G, N, 2]
            group_size = module.in_features // scales_and_zeros.shape[0]
            layer = Int4Linear(state[f"{name}.packed"], scales_and_zeros, bias, group_size)
        else:
            layer = Int8Linear(state[f"{name}.weight"], state[f"{name}.scales"], bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    rope_factors = state.pop("rope_freqs", None)
    model.load_state_dict(state, strict=True, assign=True)
    family_of(model.config).fuse_w4a8(model)
    model.finish_loading(rope_factors)
    if model.dtype != dtype:
        raise SpecDecodeError(f"{path} holds a {model.dtype} model, not {dtype}; delete it to rebuild")
    return model.eval()
