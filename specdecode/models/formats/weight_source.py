"""Where a model's tensors come from, read a block of rows at a time: a Hugging Face-style folder or a GGUF file.

Reading by rows keeps a quantized load from ever holding a whole tensor in float32, let alone the model: a
block is dequantized, requantized and dropped before the next one is read, so the peak stays near the size of
the result (the 1.5B's is measured in docs/benchmarks/README.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdecode.errors import SpecDecodeError
from specdecode.models.formats import gguf_qwen35
from specdecode.models.formats.gemma_names import NOT_TEXT_PREFIXES, gemma_shapes, gemma_sources, unread_names
from specdecode.models.formats.gguf_convert import (
    config_from_gguf,
    dequantize_tensor,
    field_value,
    hf_namer,
    open_gguf,
    permuted_heads,
    to_hf_rows,
    to_hf_tensor,
)
from specdecode.models.formats.gguf_int4 import q4_k_groups
from specdecode.models.formats.hybrid_names import VISION_PREFIX, hybrid_mtp_names, hybrid_shapes, hybrid_sources
from specdecode.models.formats.safetensors_read import read_header
from specdecode.models.model_config import ModelConfig

ALL_ROWS = slice(None)
_CHUNK_ELEMENTS = 1 << 23  # 32 MB of float32 per block of rows, whatever the row length


def parameter_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Each of our parameter names -> the Hugging Face names (without "model.") stacked into it, in order.

    q/k/v and gate/up are fused so each layer streams two fewer weights per token.
    """
    if config.is_hybrid:
        return hybrid_sources(config)
    if config.is_gemma:
        return gemma_sources(config)
    sources = {"embed.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        sources.update(_block_sources(f"layers.{i}.", f"layers.{i}.", config))
    for j in range(config.mtp_layers):
        sources.update(mtp_sources(j, config))
    return sources


def _block_sources(dst: str, src: str, config: ModelConfig) -> dict[str, list[str]]:
    """One decoder layer's parameters under prefix `dst` -> the Hugging Face names under `src` they stack."""
    sources = {dst + "attn_norm.weight": [src + "input_layernorm.weight"],
               dst + "mlp_norm.weight": [src + "post_attention_layernorm.weight"]}
    kinds = {"qkv": config.qkv_bias, "o": config.o_bias, "gate_up": config.mlp_bias, "down": config.mlp_bias}
    for kind in ("weight", "bias"):
        if kind == "weight" or kinds["qkv"]:
            sources[dst + f"attn.qkv.{kind}"] = [src + f"self_attn.{p}_proj.{kind}" for p in "qkv"]
        if kind == "weight" or kinds["o"]:
            sources[dst + f"attn.o.{kind}"] = [src + f"self_attn.o_proj.{kind}"]
        if kind == "weight" or kinds["gate_up"]:
            sources[dst + f"mlp.gate_up.{kind}"] = [src + f"mlp.{p}_proj.{kind}" for p in ("gate", "up")]
        if kind == "weight" or kinds["down"]:
            sources[dst + f"mlp.down.{kind}"] = [src + f"mlp.down_proj.{kind}"]
    if config.qk_norm:
        sources[dst + "attn.q_norm.weight"] = [src + "self_attn.q_norm.weight"]
        sources[dst + "attn.k_norm.weight"] = [src + "self_attn.k_norm.weight"]
    return sources


# Our MTP module parts (decoder/mtp.py) -> their names in each layout, after the layout's prefix.
MTP_NAMES = {
    "deepseek": {"token_norm": "enorm", "hidden_norm": "hnorm", "proj": "eh_proj", "out_norm": "shared_head.norm"},
    "mimo": {"token_norm": "token_layernorm", "hidden_norm": "hidden_layernorm", "proj": "input_proj",
             "out_norm": "final_layernorm"},
}
# DeepSeek-named modules may carry copies of the trunk's embedding and head ("shares parameters" in
# DeepSeek-V3's README_WEIGHTS); like SGLang we use the trunk's own and never read these.
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_prefix(j: int, config: ModelConfig) -> str:
    """Where MTP module j's tensors live, without "model." (DeepSeek numbers them after the trunk's layers)."""
    return f"mtp_layers.{j}." if config.mtp_layout == "mimo" else f"layers.{config.num_layers + j}."


def mtp_sources(j: int, config: ModelConfig) -> dict[str, list[str]]:
    src, dst = mtp_prefix(j, config), f"mtp.{j}."
    sources = {f"{dst}{ours}.weight": [f"{src}{theirs}.weight"] for ours, theirs in MTP_NAMES[config.mtp_layout].items()}
    return sources | _block_sources(dst + "block.", src, config)


def with_present_mtp(config: ModelConfig, weights: FolderWeights | GGUFWeights) -> ModelConfig:
    """The config with as many MTP modules as `weights` hold (a conversion may have dropped them)."""
    return replace(config, mtp_layers=mtp_tensors_present(weights.names(), config))


def mtp_tensors_present(names: set[str], config: ModelConfig) -> int:
    """How many of the MTP modules the config declares the weight names `names` (without "model.") hold: all
    of them or none (a conversion that dropped them); a part of them is one clear error."""
    if not config.mtp_declared:
        return 0
    declared = replace(config, mtp_layers=config.mtp_declared)
    if config.is_hybrid:
        wanted = hybrid_mtp_names(config)
    else:
        wanted = {name for j in range(config.mtp_declared) for names_ in mtp_sources(j, declared).values()
                  for name in names_}
    found = wanted & names
    if found and found != wanted:
        raise SpecDecodeError(f"the weights hold only part of the {config.mtp_declared} MTP layers the config "
                              f"declares; missing {', '.join(sorted(wanted - found)[:3])}")
    return config.mtp_declared if found else 0


def matching_sources(weights: FolderWeights | GGUFWeights, where: Path, config: ModelConfig) -> dict[str, list[str]]:
    """parameter_sources(config) once the weights are known to fit it: the same layers, every needed tensor
    present with the shape the config implies, none left over. Otherwise one message naming what differs, before
    anything is allocated (a config whose sizes disagree with its weights would fail deep in PyTorch)."""
    available = weights.names()
    layers = {int(name.split(".")[1]) for name in available if name.startswith("layers.") and name.split(".")[1].isdigit()}
    if config.mtp_layout == "deepseek":  # DeepSeek numbers its MTP modules after the trunk's layers
        layers -= set(range(config.num_layers, config.num_layers + config.mtp_declared))
    if len(layers) != config.num_layers:
        raise SpecDecodeError(f"{where}: the config says {config.num_layers} layers but the weights hold {len(layers)}")
    sources = parameter_sources(config)
    needed = {name for names in sources.values() for name in names}
    missing = sorted(needed - available)
    # A tied head stored anyway is harmless (and a multimodal checkpoint's vision tower, which is not read);
    # anything else unused means a different model.
    unread = unread_names(config) if config.is_gemma else set()
    unexpected = sorted(name for name in available - needed - {"lm_head.weight", "rope_freqs"} - unread
                        - _mtp_shared_copies(config) if not name.startswith((VISION_PREFIX, *NOT_TEXT_PREFIXES)))
    if missing or unexpected:
        raise SpecDecodeError(
            f"{where}: weights do not match a {config.architecture} model"
            + (f"; missing {', '.join(missing[:5])}" if missing else "")
            + (f"; unexpected {', '.join(unexpected[:5])}" if unexpected else "")
        )
    expected = expected_shapes(config)
    for name in sorted(needed | (available & {"rope_freqs"})):
        shape = weights.shape(name)
        if shape != expected[name]:
            raise SpecDecodeError(f"{where}: {name} has shape {list(shape)} but the config implies "
                                  f"{list(expected[name])}; config.json does not belong to these weights")
    return sources


def _mtp_shared_copies(config: ModelConfig) -> set[str]:
    if config.mtp_layout != "deepseek":
        return set()
    return {mtp_prefix(j, config) + name for j in range(config.mtp_layers) for name in MTP_SHARED_COPIES}


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name (without "model.") -> the shape the config implies for it."""
    if config.is_hybrid:
        return hybrid_shapes(config)
    if config.is_gemma:
        return gemma_shapes(config)
    hidden, inner, head = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_heads * head, config.num_kv_heads * head
    shapes = {"embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (config.vocab_size, hidden),
              "norm.weight": (hidden,), "rope_freqs": (head // 2,)}
    per_layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
                 "self_attn.q_proj.weight": (q_size, hidden), "self_attn.k_proj.weight": (kv_size, hidden),
                 "self_attn.v_proj.weight": (kv_size, hidden), "self_attn.o_proj.weight": (hidden, q_size),
                 "self_attn.q_proj.bias": (q_size,), "self_attn.k_proj.bias": (kv_size,),
                 "self_attn.v_proj.bias": (kv_size,), "self_attn.o_proj.bias": (hidden,),
                 "mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden),
                 "mlp.down_proj.weight": (hidden, inner), "mlp.gate_proj.bias": (inner,),
                 "mlp.up_proj.bias": (inner,), "mlp.down_proj.bias": (hidden,),
                 "self_attn.q_norm.weight": (head,), "self_attn.k_norm.weight": (head,)}
    for i in range(config.num_layers):
        shapes.update({f"layers.{i}.{name}": shape for name, shape in per_layer.items()})
    for j in range(config.mtp_layers):
        prefix, parts = mtp_prefix(j, config), MTP_NAMES[config.mtp_layout]
        shapes.update({f"{prefix}{name}": shape for name, shape in per_layer.items()})
        shapes.update({f"{prefix}{parts[norm]}.weight": (hidden,) for norm in ("token_norm", "hidden_norm", "out_norm")})
        shapes[f"{prefix}{parts['proj']}.weight"] = (hidden, 2 * hidden)
    return shapes


class FolderWeights:
    """The *.safetensors files of a Hugging Face-style folder, memory-mapped, tensors read on demand."""

    def __init__(self, files: list[Path]):
        self._handles = {}
        self._file_of: dict[str, tuple[Path, str]] = {}  # our key (no "model.") -> file and stored key
        for file in files:
            read_header(file)  # every entry checked against the file: safe_open is handed no crafted offsets
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as error:
                raise SpecDecodeError(f"{file} is corrupt or truncated ({error})") from None
            self._handles[file] = handle
            for key in handle.keys():
                # A multimodal checkpoint keeps its language model under model.language_model.
                self._file_of[key.removeprefix("model.").removeprefix("language_model.")] = (file, key)

    def names(self) -> set[str]:
        return set(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        file, key = self._file_of[name]
        return tuple(self._handles[file].get_slice(key).get_shape())

    def get(self, name: str, rows: slice = ALL_ROWS) -> torch.Tensor:
        """The tensor, or its rows `rows`, in the stored dtype."""
        file, key = self._file_of[name]
        try:
            handle = self._handles[file]
            return handle.get_tensor(key) if rows == ALL_ROWS else handle.get_slice(key)[rows]
        except (SafetensorError, OSError) as error:
            raise SpecDecodeError(f"{file} is corrupt or truncated ({error})") from None

    def is_q4_k(self, name: str) -> bool:
        return False  # safetensors hold float weights only


class GGUFWeights:
    """The tensors of a GGUF file under Hugging Face names, dequantized one at a time on demand."""

    def __init__(self, path: Path, companion: bool = False):
        """`companion`: the file may hold MTP layers alone (formats/mtp_companion.py reads those)."""
        self.reader = open_gguf(path)
        self.config = config_from_gguf(self.reader, path, companion)
        names = hf_namer(self.reader, self.config)
        self._tensors = {names(t.name).removeprefix("model."): t for t in self.reader.tensors}
        self._permute = field_value(self.reader, "general.architecture") == "llama"
        # The vocabulary's arrays are never read from here (transformers builds the tokenizer from the file), and
        # parsed they hold a third of a GiB of small numpy objects for Qwen2.5's 151k tokens.
        fields = self.reader.fields
        for key in [key for key, field in fields.items() if key.startswith("tokenizer.ggml.") and len(field.data) > 1]:
            del fields[key]

    def names(self) -> set[str]:
        return set(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(int(d) for d in reversed(self._tensors[name].shape))  # GGUF lists dims innermost first
        return gguf_qwen35.hf_shape(name, shape) if self.config.is_hybrid else shape

    def get(self, name: str, rows: slice = ALL_ROWS) -> torch.Tensor:
        """The tensor, or its rows `rows`, in float32 in PyTorch's [out, in] layout, q/k rows back in Hugging
        Face order."""
        tensor = self._tensors[name]
        if not self._converted(name):
            return torch.from_numpy(dequantize_tensor(tensor, rows))
        # Reordered or re-valued tensors (llama q/k rows, a qwen35 file's value heads and norms) are read whole;
        # they are among the smallest
        return to_hf_tensor(name, torch.from_numpy(dequantize_tensor(tensor)), self.config, self._permute)[rows]

    def _converted(self, name: str) -> bool:
        """Whether the file stores tensor `name` otherwise than Hugging Face does."""
        if self.config.is_hybrid:
            return gguf_qwen35.transforms(name, self.config)
        return permuted_heads(name, self.config, self._permute) is not None

    def is_q4_k(self, name: str) -> bool:
        from gguf import GGMLQuantizationType

        # Columns moved in blocks of value heads would split the file's groups: such a tensor is requantized.
        moved_columns = self.config.is_hybrid and gguf_qwen35.is_reordered_by_columns(name, self.config)
        return self._tensors[name].tensor_type == GGMLQuantizationType.Q4_K and not moved_columns

    def q4_k(self, name: str, rows: slice = ALL_ROWS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A Q4_K tensor's (or its rows') exact int4 groups: codes [N, K], scales and zeros [N, K/32]."""
        tensor = self._tensors[name]
        if not self._converted(name):
            return q4_k_groups(tensor, rows)
        return tuple(to_hf_rows(name, part, self.config, self._permute)[rows] for part in q4_k_groups(tensor))


def stacked(source: FolderWeights | GGUFWeights, names: list[str]) -> torch.Tensor:
    """The tensors `names` stacked along dim 0, without a copy when there is only one."""
    parts = [source.get(n) for n in names]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def stacked_as(source: FolderWeights | GGUFWeights, names: list[str], dtype: torch.dtype) -> torch.Tensor:
    """`stacked(...).to(dtype)` without ever holding a whole tensor in float32 (the embedding's is 0.9 GB)."""
    shapes = [source.shape(n) for n in names]
    out = torch.empty(sum(s[0] for s in shapes), *shapes[0][1:], dtype=dtype)  # [N, ...]
    start = 0
    for chunk in row_blocks(source, names, source.get):
        out[start : start + len(chunk)] = chunk
        start += len(chunk)
    return out


def row_blocks(source: FolderWeights | GGUFWeights, names: list[str], read: Callable) -> Iterator:
    """`read(name, rows)` over the tensors `names` in stacking order, a block of about 32 MB of float32 rows
    at a time."""
    for name in names:
        shape = source.shape(name)
        step = max(64, _CHUNK_ELEMENTS // math.prod(shape[1:]) // 64 * 64)
        for start in range(0, shape[0], step):
            yield read(name, slice(start, min(start + step, shape[0])))
