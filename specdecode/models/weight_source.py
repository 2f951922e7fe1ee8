"""Where a model's tensors come from, read one at a time: a Hugging Face-style folder or a GGUF file.

Reading tensor by tensor keeps a quantized load from ever holding the whole model in float: a layer is
dequantized, requantized and dropped before the next one is read.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdecode.errors import SpecDecodeError
from specdecode.models.gguf_convert import config_from_gguf, dequantize_tensor, field_value, hf_name, open_gguf, \
    to_hf_rows
from specdecode.models.gguf_int4 import q4_k_groups
from specdecode.models.model_config import ModelConfig


def parameter_sources(config: ModelConfig) -> dict[str, list[str]]:
    """Each of our parameter names -> the Hugging Face names (without "model.") stacked into it, in order.

    q/k/v and gate/up are fused so each layer streams two fewer weights per token.
    """
    sources = {"embed.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
    if not config.tie_word_embeddings:
        sources["lm_head.weight"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        dst, src = f"layers.{i}.", f"layers.{i}."
        sources[dst + "attn_norm.weight"] = [src + "input_layernorm.weight"]
        sources[dst + "mlp_norm.weight"] = [src + "post_attention_layernorm.weight"]
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


def check_sources(sources: dict[str, list[str]], available: set[str], where: Path, config: ModelConfig) -> None:
    """Every needed tensor present and none left over, or one message naming the first few of each."""
    needed = {name for names in sources.values() for name in names}
    missing = sorted(needed - available)
    # A tied head stored anyway is harmless; anything else unused means a different model.
    unexpected = sorted(available - needed - {"lm_head.weight", "rope_freqs"})
    if missing or unexpected:
        raise SpecDecodeError(
            f"{where}: weights do not match a {config.architecture} model"
            + (f"; missing {', '.join(missing[:5])}" if missing else "")
            + (f"; unexpected {', '.join(unexpected[:5])}" if unexpected else "")
        )


class FolderWeights:
    """The *.safetensors files of a Hugging Face-style folder, memory-mapped, tensors read on demand."""

    def __init__(self, files: list[Path]):
        self._handles = {}
        self._file_of: dict[str, tuple[Path, str]] = {}  # our key (no "model.") -> file and stored key
        for file in files:
            try:
                handle = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as error:
                raise SpecDecodeError(f"{file} is corrupt or truncated ({error})") from None
            self._handles[file] = handle
            for key in handle.keys():
                self._file_of[key.removeprefix("model.")] = (file, key)

    def names(self) -> set[str]:
        return set(self._file_of)

    def get(self, name: str) -> torch.Tensor:
        file, key = self._file_of[name]
        try:
            return self._handles[file].get_tensor(key)
        except (SafetensorError, OSError) as error:
            raise SpecDecodeError(f"{file} is corrupt or truncated ({error})") from None

    def q4_k(self, name: str) -> None:
        return None  # safetensors hold float weights only


class GGUFWeights:
    """The tensors of a GGUF file under Hugging Face names, dequantized one at a time on demand."""

    def __init__(self, path: Path):
        self.reader = open_gguf(path)
        self.config = config_from_gguf(self.reader, path)
        self._tensors = {hf_name(t.name).removeprefix("model."): t for t in self.reader.tensors}
        self._permute = field_value(self.reader, "general.architecture") == "llama"

    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        """float32 in PyTorch's [out, in] layout, q/k rows back in Hugging Face order."""
        return to_hf_rows(name, torch.from_numpy(dequantize_tensor(self._tensors[name])), self.config,
                          self._permute)

    def q4_k(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A Q4_K tensor's exact int4 groups (codes, scales, zeros), or None for any other type."""
        from gguf import GGMLQuantizationType

        tensor = self._tensors[name]
        if tensor.tensor_type != GGMLQuantizationType.Q4_K:
            return None
        return tuple(to_hf_rows(name, part, self.config, self._permute) for part in q4_k_groups(tensor))


def stacked(source: FolderWeights | GGUFWeights, names: list[str]) -> torch.Tensor:
    """The tensors `names` stacked along dim 0, without a copy when there is only one."""
    parts = [source.get(n) for n in names]
    return parts[0] if len(parts) == 1 else torch.cat(parts)
