"""Name or path -> ready model and tokenizer: a default name, a GGUF file, or a Hugging Face-style folder.

GGUF files (the defaults included) are converted once into a cached Hugging Face-style folder; from then on
every source loads the same way, from memory-mapped safetensors. Pickled weights are never read.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdecode.errors import SpecDecodeError
from specdecode.models.gguf_convert import convert_gguf
from specdecode.models.gguf_int4 import Q4_K_GROUP, replace_q4_k_linears
from specdecode.models.model_config import ModelConfig
from specdecode.models.packed_linear import can_pack, pack_linears
from specdecode.models.quantized_linear import check_quant, quantize_linears
from specdecode.models.registry import DEFAULT_MODELS, assemble, cache_dir
from specdecode.models.transformer import Transformer
from specdecode.tokenizer import Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: Tokenizer
    folder: Path  # the Hugging Face-style folder the weights came from (converted, for GGUF sources)

    @property
    def config(self) -> ModelConfig:
        return self.model.config


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # bf16 halves the bytes streamed per token; use it where the hardware computes it natively.
        if device.startswith("cuda") or _cpu_has_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise SpecDecodeError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _cpu_has_bf16() -> bool:
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check() for check in checks if check is not None)


def load_model(name_or_path: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu",
               quiet: bool = False, quant: str = "none", group_size: int = 32) -> LoadedModel:
    """Load a default model name, a .gguf file or a Hugging Face-style folder (config.json + *.safetensors).

    quant: "none", "int8" (per-channel) or "int4" (group-wise, `group_size` inputs per group), weight-only.
    """
    torch_dtype = resolve_dtype(dtype, device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecDecodeError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    check_quant(quant, group_size)
    folder, gguf_path = resolve_folder(str(name_or_path), torch_dtype, quiet)
    model = load_folder(folder, torch_dtype, device, quant, group_size, gguf_path)
    tokenizer = Tokenizer.from_folder(folder, model.config)
    return LoadedModel(str(name_or_path), model, tokenizer, folder)


def resolve_folder(name_or_path: str, dtype: torch.dtype, quiet: bool) -> tuple[Path, Path | None]:
    """-> the Hugging Face-style folder to load, and the GGUF file it was converted from (if any)."""
    path = Path(name_or_path).expanduser()
    if name_or_path in DEFAULT_MODELS:
        path = assemble(DEFAULT_MODELS[name_or_path], quiet=quiet)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return converted_folder(path, dtype, quiet), path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecDecodeError(f"{path} has no config.json; a model folder needs config.json and *.safetensors")
        return path, None
    if path.exists():
        raise SpecDecodeError(f"{path} is neither a .gguf file nor a model folder")
    raise SpecDecodeError(
        f"unknown model {name_or_path!r}: not a default name ({', '.join(DEFAULT_MODELS)}), "
        "nor an existing .gguf file or model folder"
    )


def converted_folder(gguf_path: Path, dtype: torch.dtype, quiet: bool) -> Path:
    """The cached conversion of a GGUF file, keyed by its path, size and mtime so an edited file converts anew."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "converted" / f"{gguf_path.stem}-{key}-{str(dtype)[6:]}"
    if (folder / "config.json").is_file():
        return folder
    return convert_gguf(gguf_path, folder, dtype, quiet)


def load_folder(folder: Path, dtype: torch.dtype, device: str, quant: str = "none", group_size: int = 32,
                gguf_path: Path | None = None) -> Transformer:
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as error:
        raise SpecDecodeError(f"{folder / 'config.json'} is not valid JSON ({error})") from None
    config = ModelConfig.from_hf(hf_config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {', '.join(bins)}: pickled weights are never loaded; convert them to safetensors)" if bins else ""
        raise SpecDecodeError(f"{folder} has no *.safetensors weights{hint}")
    hf_state = read_safetensors(files)
    rope_factors = hf_state.pop("rope_freqs", None)
    state = to_our_names(hf_state, config)
    with torch.device("meta"):
        model = Transformer(config)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise SpecDecodeError(
            f"{folder}: weights do not match a {config.architecture} model"
            + (f"; missing {', '.join(missing[:5])}" if missing else "")
            + (f"; unexpected {', '.join(unexpected[:5])}" if unexpected else "")
        )
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    model.finish_loading(rope_factors)
    if quant == "int4" and group_size == Q4_K_GROUP and gguf_path is not None:
        replace_q4_k_linears(model, gguf_path)  # the file's own 4-bit weights, not a requantization
    if quant != "none":
        quantize_linears(model, quant, group_size)  # every layer still in float
    elif can_pack(model):
        pack_linears(model)
    return model.eval()


def read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    state = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    state[key] = handle.get_tensor(key)
        except (SafetensorError, OSError) as error:
            raise SpecDecodeError(f"{file} is corrupt or truncated ({error})") from None
    return state


def to_our_names(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face parameter names -> ours, fusing q/k/v and gate/up so each layer streams two fewer weights."""
    hf = {k.removeprefix("model."): v for k, v in hf.items()}
    state = {"embed.weight": hf.pop("embed_tokens.weight", None), "norm.weight": hf.pop("norm.weight", None)}
    if "lm_head.weight" in hf:
        head = hf.pop("lm_head.weight")
        if not config.tie_word_embeddings:
            state["lm_head.weight"] = head
    for i in range(config.num_layers):
        dst = f"layers.{i}."

        def take(name: str, prefix: str = dst) -> torch.Tensor | None:
            return hf.pop(prefix + name, None)

        state[dst + "attn_norm.weight"] = take("input_layernorm.weight")
        state[dst + "mlp_norm.weight"] = take("post_attention_layernorm.weight")
        for kind in ("weight", "bias"):
            parts = [take(f"self_attn.{p}_proj.{kind}") for p in "qkv"]
            if all(p is not None for p in parts):
                state[dst + f"attn.qkv.{kind}"] = torch.cat(parts)
            state[dst + f"attn.o.{kind}"] = take(f"self_attn.o_proj.{kind}")
            gate, up = take(f"mlp.gate_proj.{kind}"), take(f"mlp.up_proj.{kind}")
            if gate is not None and up is not None:
                state[dst + f"mlp.gate_up.{kind}"] = torch.cat([gate, up])
            state[dst + f"mlp.down.{kind}"] = take(f"mlp.down_proj.{kind}")
        state[dst + "attn.q_norm.weight"] = take("self_attn.q_norm.weight")
        state[dst + "attn.k_norm.weight"] = take("self_attn.k_norm.weight")
    # Anything left over was not consumed: report it as unexpected rather than silently dropping it.
    state.update(hf)
    return {k: v for k, v in state.items() if v is not None}
