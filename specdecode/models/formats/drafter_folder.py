"""What every drafter folder with weights of its own shares (EAGLE-3 heads, DFlash drafters): a config.json
read with one clear error, stored tensors checked against the module before they load, and both written whole;
and where `specdecode train` puts a trained drafter for a target by default (where `auto` looks for one)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.formats.default_models import DEFAULT_TARGET, cache_dir


def read_drafter_config(folder: Path, what: str) -> dict:
    """folder/config.json as a dict, or one error naming the drafter kind `what` ("an EAGLE-3 head")."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise SpecDecodeError(f"{folder} is not {what} folder (no config.json)")
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SpecDecodeError(f"cannot read {config_file} ({error})") from None
    if not isinstance(hf, dict):
        raise SpecDecodeError(f"{config_file} must hold a JSON object")
    return hf


def load_checked(module: nn.Module, tensors: dict[str, torch.Tensor], folder: Path, what: str) -> None:
    """Load `tensors` (our names) into `module` once every one is present, known and of the config's shape."""
    expected = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise SpecDecodeError(f"{folder}: the {what} lacks {', '.join(missing[:3])}")
    for name, tensor in tensors.items():
        if name not in expected:
            raise SpecDecodeError(f"{folder}: unexpected tensor {name!r} for this {what}'s config")
        if tuple(tensor.shape) != expected[name]:
            raise SpecDecodeError(f"{folder}: {name} has shape {tuple(tensor.shape)}, the config implies "
                                  f"{expected[name]}; was it made for another target?")
    module.load_state_dict(tensors)


def write_drafter_folder(folder: Path, tensors: dict[str, torch.Tensor], hf: dict, what: str) -> Path:
    """model.safetensors and config.json into `folder`, each written whole under a temporary name and then
    renamed: never half a drafter. `what` names it in the one error ("the head")."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors.partial"))
        (folder / "config.json.partial").write_text(json.dumps(hf, indent=1))
        (folder / "config.json.partial").replace(folder / "config.json")
        (folder / "model.safetensors.partial").replace(folder / "model.safetensors")
    except OSError as error:
        raise SpecDecodeError(f"cannot write {what} to {folder} ({error})") from None
    return folder


def model_label(target: str) -> str:
    """A target's short name: a default name as is, a .gguf file's stem, a folder's name."""
    path = Path(target)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def trained_folder(kind: str, target: str | None) -> Path:
    """Where `specdecode train KIND` writes its result for `target` (None: the default target) by default, and
    where `auto` looks for a trained drafter of that kind; `kind` "features" is the target's features."""
    return cache_dir() / kind / model_label(target or DEFAULT_TARGET)


def holds_weights(folder: Path) -> bool:
    """Whether `folder` holds a drafter's config and weights (a finished training run's output)."""
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
