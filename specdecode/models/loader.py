"""Name or path -> ready model and tokenizer: a default name, a GGUF file, or a Hugging Face-style folder.

In float, GGUF files (the defaults included) are converted once into a cached Hugging Face-style folder, and
from then on every source loads the same way, from safetensors. Quantized models are built tensor by tensor
straight from the source and cached in their packed form (quantized_model.py). Pickled weights are never read.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.auto_quant import choose_quant
from specdecode.models.decoder.packed_linear import PackedLinear, can_pack, pack_linears
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.families.registry import config_from_hf, config_to_hf, family_of
from specdecode.models.formats.default_models import DEFAULT_MODELS, assemble, cache_dir
from specdecode.models.formats.weight_source import FolderWeights, stacked
from specdecode.models.gguf_conversion import convert_gguf, write_tokenizer
from specdecode.models.kernels.quantized_linear import check_quant
from specdecode.models.memory_needed import check_memory
from specdecode.models.model_config import ModelConfig
from specdecode.models.model_files import matching_sources, open_gguf_weights, with_present_mtp
from specdecode.models.quantized_model import load_quantized, quantized_cache_folder
from specdecode.models.tokenizer import Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    name: str
    model: Transformer
    tokenizer: Tokenizer
    folder: Path  # holds config.json and the tokenizer (a GGUF source's cached conversion or quantized copy)
    quant: str = "none"  # how its weights were loaded (what --quant auto chose)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def weights_bytes(self) -> int:
        return module_bytes(self.model)


def module_bytes(module: torch.nn.Module) -> int:
    """Memory a module's weights hold (tied weights counted once; quantized codes at their packed size; oneDNN's
    prepacked weights, which are no state of the module, at their element size)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in module.state_dict().values()}
    packed = [m.packed_weight for m in module.modules() if isinstance(m, PackedLinear)]
    return sum(storages.values()) + sum(w.element_size() * w.numel() for w in packed)


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


def check_device(device: str) -> None:
    """cpu, cuda or cuda:N on a machine that has it, or one clear message."""
    kind, colon, index = str(device).partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit())):
        raise SpecDecodeError(f"unknown device {device!r}; use cpu, cuda or cuda:N")
    if kind == "cuda" and not torch.cuda.is_available():
        raise SpecDecodeError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    if index and int(index) >= torch.cuda.device_count():
        raise SpecDecodeError(f"device {device!r} requested but this machine has {torch.cuda.device_count()} "
                              "CUDA devices")


def _cpu_has_bf16() -> bool:
    checks = (getattr(torch.cpu, "_is_avx512_bf16_supported", None), getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(check() for check in checks if check is not None)


def load_model(name_or_path: str | Path, dtype: str | torch.dtype = "auto", device: str = "cpu",
               quiet: bool = False, quant: str = "auto", group_size: int = 32) -> LoadedModel:
    """Load a default name, a .gguf file or a Hugging Face-style folder (config.json + *.safetensors).

    quant: "none", "int8" (per channel) or "int4" (group-wise, `group_size` inputs per group), weight-only;
    "w4a8" (int4 weights, int8 activations); "w3a8" (the same with 3-bit weights); "auto" chooses (auto_quant.py) and says what and why unless
    quiet. Quantized models are built tensor by tensor from the source and cached (see quantized_model.py).
    """
    check_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if quant != "auto":
        check_quant(quant, group_size)
    if quant not in ("none", "auto") and device != "cpu":
        raise SpecDecodeError(f"--quant {quant} runs on the CPU kernels; use --device cpu or --quant none")
    source = resolve_source(str(name_or_path), quiet)
    if quant == "auto":
        quant, reason = choose_quant(source, device, group_size, quiet)
        if not quiet and source.is_file():  # a folder's weights load as stored: nothing was chosen
            print(f"{Path(str(name_or_path)).name}: --quant auto -> {quant} ({reason})", file=sys.stderr)
    if quant == "none":
        folder = _float_folder(source, torch_dtype, quiet)
        model = load_folder(folder, torch_dtype, device, quiet)
    else:
        model, folder = load_quantized_source(source, torch_dtype, quant, group_size, quiet)
    tokenizer = Tokenizer.from_folder(folder, model.config)
    return LoadedModel(str(name_or_path), model, tokenizer, folder, quant)


def resolve_source(name_or_path: str, quiet: bool) -> Path:
    """-> a .gguf file or a Hugging Face-style folder (default names are assembled from their packages)."""
    if not name_or_path.strip():  # Path("") is the working folder, which would be blamed for having no config.json
        raise SpecDecodeError(f"the model name is empty; give a default name ({', '.join(DEFAULT_MODELS)}), a .gguf "
                              "file or a model folder")
    path = Path(name_or_path).expanduser()
    if name_or_path in DEFAULT_MODELS:
        path = assemble(DEFAULT_MODELS[name_or_path], quiet=quiet)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecDecodeError(f"{path} has no config.json; a model folder needs config.json and *.safetensors")
        return path
    if path.exists():
        raise SpecDecodeError(f"{path} is neither a .gguf file nor a model folder")
    raise SpecDecodeError(
        f"unknown model {name_or_path!r}: not a default name ({', '.join(DEFAULT_MODELS)}), "
        "nor an existing .gguf file or model folder"
    )


def float_folder(name_or_path: str, dtype: torch.dtype, quiet: bool = True) -> Path:
    """The Hugging Face-style folder holding a model's float weights (a GGUF file's cached conversion)."""
    return _float_folder(resolve_source(name_or_path, quiet), dtype, quiet)


def _float_folder(source: Path, dtype: torch.dtype, quiet: bool) -> Path:
    return converted_folder(source, dtype, quiet) if source.is_file() else source


def load_quantized_source(source: Path, dtype: torch.dtype, quant: str, group_size: int,
                          quiet: bool) -> tuple[Transformer, Path]:
    """-> the quantized model and the folder holding its config and tokenizer."""
    files = [source] if source.is_file() else safetensors_files(source)
    cache = quantized_cache_folder(files, dtype, quant, group_size)
    if source.is_file() and (cache / "config.json").is_file():
        # Cached (the folder is written whole): the GGUF file is not opened, which would parse its whole
        # vocabulary (half a GiB of metadata for Qwen2.5's 151k tokens).
        config = read_config(cache)
        check_memory(config, dtype, quant, source.name, quiet)
        return load_quantized(None, config, source, cache, dtype, quant, group_size, quiet), cache
    if source.is_file():
        weights = open_gguf_weights(source)
        config = weights.config
    else:
        config = read_config(source)
        weights = FolderWeights(files)
        config = with_present_mtp(config, weights)

    def write_gguf_tokenizer(folder: Path) -> None:  # the file's own vocabulary, merges and chat template
        (folder / "config.json").write_text(json.dumps(config_to_hf(config), indent=1))
        write_tokenizer(source, folder, config)

    extra = write_gguf_tokenizer if source.is_file() else None
    matching_sources(weights, source, config)  # a config its weights contradict fails here, before it is sized
    check_memory(config, dtype, quant, source.name, quiet)
    model = load_quantized(weights, config, source, cache, dtype, quant, group_size, quiet, extra)
    return model, cache if source.is_file() else source


def converted_folder(gguf_path: Path, dtype: torch.dtype, quiet: bool) -> Path:
    """The cached conversion of a GGUF file, keyed by its path, size and mtime so an edited file converts anew."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "converted" / f"{gguf_path.stem}-{key}-{str(dtype)[6:]}"
    if (folder / "config.json").is_file():
        return folder
    return convert_gguf(gguf_path, folder, dtype, quiet)


def read_config(folder: Path) -> ModelConfig:
    try:
        hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise SpecDecodeError(f"{folder / 'config.json'} is not valid JSON ({error})") from None
    if not isinstance(hf, dict):
        raise SpecDecodeError(f"{folder / 'config.json'} must hold a JSON object, not {type(hf).__name__}")
    return config_from_hf(hf)


def safetensors_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        hint = f" (found {', '.join(bins)}: pickled weights are never loaded; convert them to safetensors)" if bins else ""
        raise SpecDecodeError(f"{folder} has no *.safetensors weights{hint}")
    return files


def load_folder(folder: Path, dtype: torch.dtype, device: str, quiet: bool = True) -> Transformer:
    config = read_config(folder)  # first: an unsupported architecture says so before its weights are opened
    weights = FolderWeights(safetensors_files(folder))
    config = with_present_mtp(config, weights)
    sources = matching_sources(weights, folder, config)
    check_memory(config, dtype, "none", folder.name, quiet)
    rope_factors = weights.get("rope_freqs") if "rope_freqs" in weights.names() else None
    state = {name: stacked(weights, names).to(device=device, dtype=dtype) for name, names in sources.items()}
    family = family_of(config)
    with torch.device("meta"):
        model = family.build(config)
    model.load_state_dict(state, strict=False, assign=True)
    model.finish_loading(rope_factors)
    if can_pack(model):
        pack_linears(model)
    not_fixed = family.fix_float(model)
    if not_fixed and device == "cpu" and not quiet:
        print(f"{folder.name}: PyTorch decoder layers, not batch-invariant ({not_fixed}): speculative output may "
              f"differ from plain decoding where the top two logits tie", file=sys.stderr)
    return model.eval()
