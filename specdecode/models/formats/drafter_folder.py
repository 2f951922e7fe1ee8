"""What every drafter folder with weights of its own shares (EAGLE-3 heads, DFlash drafters): a config.json
read with one clear error, and stored tensors checked against the module before they load."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdecode.errors import SpecDecodeError


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
