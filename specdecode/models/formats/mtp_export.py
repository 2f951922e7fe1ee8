"""A target with trained MTP modules, written the ways MTP models ship (drafter-formats.md section 2):

- a model folder: the target's own files (its safetensors hard-linked where the file system allows, else
  copied), its config.json declaring `num_nextn_predict_layers`, and model-mtp.safetensors with the modules in
  MiMo naming (`model.mtp_layers.{j}.*`, config model_type "mimo", for a Qwen2 trunk, which vLLM's MiMo MTP
  path reads) or DeepSeek naming (`model.layers.{L+j}.*`) otherwise;
- when the target was a GGUF file: that file again with the modules added as llama.cpp stores them
  (`{arch}.nextn_predict_layers`, block_count counting them, `blk.{L+j}.nextn.*` and an ordinary block), its
  own tensors copied bit for bit, so the fast path runs the very same trunk; and the same modules as a
  companion `mtp-NAME.gguf` (llama.cpp's split layout, mtp_companion.py: its metadata, embedding, final norm
  and head, and the MTP blocks only), to use beside the original file without a second copy of the trunk.
Every file is written under a temporary name and renamed: never half a model.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.formats.gguf_read import open_gguf
from specdecode.models.formats.layer_names import (
    block_shapes,
    block_sources,
    mtp_part_shapes,
    mtp_part_sources,
    mtp_prefix,
)
from specdecode.models.model_config import ModelConfig

MTP_FILE = "model-mtp.safetensors"
# Hugging Face part names (after a DeepSeek-named module's prefix) -> llama.cpp's tensor names in block L+j.
_GGUF_NAMES = {
    "enorm.weight": "nextn.enorm.weight", "hnorm.weight": "nextn.hnorm.weight", "eh_proj.weight": "nextn.eh_proj.weight",
    "shared_head.norm.weight": "nextn.shared_head_norm.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attn_{'output' if p == 'o' else p}.{kind}" for p in "qkvo"
       for kind in ("weight", "bias")},
}


def mtp_layout(config: ModelConfig) -> str:
    """MiMo's naming for a Qwen2 trunk (vLLM's MiMo MTP path then loads it), DeepSeek's otherwise."""
    return "mimo" if config.architecture == "qwen2" else "deepseek"


def mtp_tensors(modules: nn.ModuleList, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The modules' weights (Llama-style blocks, what `specdecode train mtp` trains) under the Hugging Face names
    of `config.mtp_layout` (fused q/k/v and gate/up split back into the published tensors)."""
    state = {f"mtp.{name}": t.detach().cpu() for name, t in modules.state_dict().items()}
    for j, module in enumerate(modules):
        if module.hidden_first != (config.mtp_layout == "mimo"):  # written in the other order: swap the halves
            state[f"mtp.{j}.proj.weight"] = torch.cat(state[f"mtp.{j}.proj.weight"].chunk(2, dim=1)[::-1], dim=1)
    shapes = {}
    for j in range(config.mtp_layers):
        shapes |= {f"{mtp_prefix(j, config)}{name}": shape for name, shape in block_shapes(config).items()}
        shapes |= mtp_part_shapes(j, config)
    sources = {ours: theirs for j in range(config.mtp_layers) for ours, theirs in (
        mtp_part_sources(j, config) | block_sources(f"mtp.{j}.block.", mtp_prefix(j, config), config)).items()}
    published = {}
    for ours, names in sources.items():
        if ours in state:
            parts = state[ours].split([shapes[name][0] for name in names]) if len(names) > 1 else [state[ours]]
            published.update({f"model.{name}": part.to(dtype).contiguous() for name, part in zip(names, parts)})
    return published


def write_model_with_mtp(trunk: ModelConfig, dtype: torch.dtype, source: Path, origin: Path,
                         modules: nn.ModuleList, out: Path, quiet: bool = True) -> Path:
    """Write the target with `modules` into `out` (see the module docstring) -> `out`. `trunk`: the target's
    config; `source`: the folder of its float weights; `origin`: the file or folder it was loaded from (a GGUF
    origin is written again with the layers added, and as a companion file)."""
    count = len(modules)
    config = replace(trunk, mtp_layers=count, mtp_declared=count, mtp_layout=mtp_layout(trunk))
    try:
        out.mkdir(parents=True, exist_ok=True)
        for file in sorted(source.iterdir()):
            if file.is_file() and file.name not in ("config.json", MTP_FILE) and not file.name.endswith(".gguf"):
                _link_or_copy(file, out / file.name)
        hf = json.loads((source / "config.json").read_text()) | {"num_nextn_predict_layers": count}
        if config.mtp_layout == "mimo":
            hf |= {"model_type": "mimo", "architectures": ["MiMoForCausalLM"]}
        tensors = mtp_tensors(modules, config, dtype)
        _write(out / MTP_FILE, lambda partial: save_file(tensors, str(partial), metadata={"format": "pt"}))
        _write(out / "config.json", lambda partial: partial.write_text(json.dumps(hf, indent=1)))
        if origin.is_file():
            gguf_tensors = mtp_tensors(modules, replace(config, mtp_layout="deepseek"), torch.float32)
            _write(out / f"{origin.stem}-mtp.gguf", lambda partial: write_gguf_with_mtp(origin, partial, config,
                                                                                      gguf_tensors, quiet))
            _write(out / f"mtp-{origin.stem}.gguf", lambda partial: write_gguf_with_mtp(
                origin, partial, config, gguf_tensors, quiet, companion=True))
    except OSError as error:
        raise SpecDecodeError(f"cannot write the model with its MTP layers to {out} ({error})") from None
    return out


def write_gguf_with_mtp(origin: Path, path: Path, config: ModelConfig, tensors: dict[str, torch.Tensor],
                        quiet: bool = True, companion: bool = False) -> None:
    """`origin` again at `path` with DeepSeek-named MTP `tensors` added as llama.cpp stores them; `companion`:
    without the trunk's blocks (llama.cpp's `--mtp` file)."""
    import gguf

    reader = open_gguf(origin)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    writer = gguf.GGUFWriter(str(path), arch)
    block_count, nextn = f"{arch}.block_count", f"{arch}.nextn_predict_layers"
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", block_count, nextn):
            continue
        kinds = field.types
        writer.add_key_value(name, field.contents(), kinds[0], kinds[-1] if kinds[0] == gguf.GGUFValueType.ARRAY
                             else None)
    writer.add_block_count(config.num_layers + config.mtp_layers)
    writer.add_nextn_predict_layers(config.mtp_layers)
    for tensor in reader.tensors:  # the trunk as it was: the same codes, so the same model
        if companion and tensor.name.startswith("blk."):
            continue
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)  # quantized: shape from bytes
    for name, weight in tensors.items():
        writer.add_tensor(_gguf_name(name, config), _gguf_rows(name, weight, config, arch))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=not quiet)
    writer.close()


def _gguf_name(name: str, config: ModelConfig) -> str:
    for j in range(config.mtp_layers):
        prefix = "model." + mtp_prefix(j, replace(config, mtp_layout="deepseek"))
        if name.startswith(prefix):
            return f"blk.{config.num_layers + j}.{_GGUF_NAMES[name.removeprefix(prefix)]}"
    raise SpecDecodeError(f"no GGUF name for MTP tensor {name}")


def _gguf_rows(name: str, weight: torch.Tensor, config: ModelConfig, arch: str) -> np.ndarray:
    """Matrices as float16, norms and biases as float32 (as llama.cpp's converter stores them); llama files
    interleave q/k rows per head, as the converter does."""
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}
    kind = next((k for k in heads if f".{k}." in name), None)
    if arch == "llama" and kind is not None:
        rows = weight.shape[0]
        weight = weight.reshape(heads[kind], 2, rows // heads[kind] // 2, *weight.shape[1:]).transpose(1, 2) \
            .reshape(weight.shape)
    array = weight.float().numpy()
    return array.astype(np.float16) if array.ndim == 2 else array


def _link_or_copy(source: Path, destination: Path) -> None:
    if destination.exists():
        destination.unlink()
    try:
        os.link(source, destination)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, destination)


def _write(path: Path, write) -> None:
    partial = path.with_name(path.name + ".partial")
    write(partial)
    partial.replace(path)
