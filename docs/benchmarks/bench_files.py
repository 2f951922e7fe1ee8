"""What the benchmark scripts here write: a random model's folder, and a run's JSON and markdown report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_model_folder(folder: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """config.json, model.safetensors and the tests' byte tokenizer (a model needs a tokenizer to load; the
    random models these scripts time never decode text) -> the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from conftest import byte_tokenizer

    byte_tokenizer().save_pretrained(str(folder))
    return folder


def write_report(out: Path, stem: str, data: dict, lines: list[str]) -> None:
    """OUT/STEM.json (every number) and OUT/STEM.md (the table), the table printed too."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
