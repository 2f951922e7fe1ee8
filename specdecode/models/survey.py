"""What a model file or folder is and which drafters it brings, from its config and tensor names alone.

No weights are read: a folder's config.json and safetensors headers, a GGUF file's header (gguf_header.py).
`specdecode inspect` and `--spec-type auto` decide from this.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.models.families.registry import FAMILIES, family_for_gguf, family_for_model_type
from specdecode.models.formats import safetensors_read
from specdecode.models.formats.gguf_header import read_header
from specdecode.models.formats.mtp_companion import companion_beside, companion_layers

# Where each published MTP naming keeps module j (drafter-formats.md section 2); {L} = the trunk's layer count.
_MTP_PATTERNS = {
    "mimo": re.compile(r"model\.mtp_layers\.(\d+)\."),
    "qwen3.5": re.compile(r"mtp\.layers\.(\d+)\."),
}
# A drafter folder's kind by its config.json's architectures or speculators type (drafter-formats.md section 1);
# the assistants families ship beside their models join them (drafter_kinds).
_DRAFTER_KINDS = (("eagle3", "eagle3"), ("dflash", "dflash"), ("dspark", "dspark"), ("medusa", "medusa"))


@dataclass(frozen=True)
class ModelSurvey:
    source: Path
    architecture: str  # as the file names it (config.json's model_type, a GGUF's general.architecture)
    runs: bool  # whether this runtime runs the trunk
    mtp_declared: int  # MTP modules the config or metadata declares
    mtp_present: int  # MTP modules whose tensors the weights hold
    mtp_naming: str | None  # "deepseek", "mimo", "qwen3.5" or "gguf nextn"; None without MTP tensors
    mtp_companion: Path | None = None  # a GGUF file's MTP layers in a file of their own beside it (mtp-*.gguf)
    mtp_companion_layers: int = 0  # the MTP layers that companion holds

    @property
    def mtp_dropped(self) -> bool:
        return self.mtp_declared > 0 and self.mtp_present == 0

    @property
    def mtp_usable(self) -> int:
        """MTP layers `--spec-type mtp` would draft with: the file's own, else its companion's."""
        return self.mtp_present or self.mtp_companion_layers

    def mtp_line(self) -> str:
        if self.mtp_companion is not None and not self.mtp_present:
            return (f"{self.mtp_companion_layers} in the companion file {self.mtp_companion.name} beside it "
                    "(llama.cpp's split layout)")
        if not self.mtp_declared and not self.mtp_present:
            return "none declared"
        if self.mtp_dropped:
            return (f"{self.mtp_declared} declared in config but dropped from this file (a conversion or "
                    "quantized upload lost them)")
        return f"{self.mtp_present} present ({self.mtp_naming} naming)"


def survey(source: Path) -> ModelSurvey:
    """source: a .gguf file or a folder with config.json (loader.resolve_source's answer)."""
    return _survey_gguf(source) if source.is_file() else _survey_folder(source)


def _survey_folder(folder: Path) -> ModelSurvey:
    try:
        hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SpecDecodeError(f"{folder / 'config.json'} cannot be read ({error})") from None
    if not isinstance(hf, dict):
        raise SpecDecodeError(f"{folder / 'config.json'} must hold a JSON object")
    model_type = str(hf.get("model_type"))
    runs = family_for_model_type(model_type) is not None
    declared = int(hf.get("num_nextn_predict_layers") or hf.get("mtp_num_hidden_layers") or 0)
    trunk = int(hf.get("num_hidden_layers") or 0)
    names = _tensor_names(folder)
    found = {"deepseek": _indices(names, re.compile(r"model\.layers\.(\d+)\.eh_proj\."), offset=trunk)}
    found |= {naming: _indices(names, pattern) for naming, pattern in _MTP_PATTERNS.items()}
    naming, present = max(found.items(), key=lambda item: item[1])
    return ModelSurvey(folder, model_type, runs, declared, present, naming if present else None)


def _survey_gguf(path: Path) -> ModelSurvey:
    header = read_header(path)
    arch = str(header.metadata.get("general.architecture"))
    declared = int(header.metadata.get(f"{arch}.nextn_predict_layers", 0))
    trunk = int(header.metadata.get(f"{arch}.block_count", 0)) - declared
    present = sum(f"blk.{trunk + j}.nextn.eh_proj.weight" in header.types for j in range(declared))
    companion = None if present else companion_beside(path)
    return ModelSurvey(path, arch, family_for_gguf(arch) is not None, declared, present,
                       "gguf nextn" if present else None,
                       companion, companion_layers(companion) if companion is not None else 0)


def _tensor_names(folder: Path) -> set[str]:
    return {name for file in sorted(folder.glob("*.safetensors")) for name in safetensors_read.read_header(file)[0]}


def _indices(names: set[str], pattern: re.Pattern, offset: int = 0) -> int:
    """How many distinct modules (numbered from `offset`) the names matching `pattern` belong to."""
    return len({int(m.group(1)) for name in names if (m := pattern.match(name)) and int(m.group(1)) >= offset})


def drafter_kind(folder: Path) -> str | None:
    """The kind of drafter `folder` holds ("eagle3", "dflash", "dspark", "medusa", or a family's shipped assistant),
    by its config.json, else None."""
    try:
        hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None  # not a drafter folder: any folder may sit beside a model
    if not isinstance(hf, dict):
        return None
    described = " ".join([*map(str, hf.get("architectures") or []), str(hf.get("speculators_model_type", ""))]).lower()
    return next((kind for kind, marker in drafter_kinds() if marker in described), None)


def drafter_kinds() -> tuple[tuple[str, str], ...]:
    """(kind, how its config.json's architectures name it) for every drafter folder we recognise."""
    shipped = tuple((f.assistant.kind, f.assistant.marker) for f in FAMILIES.values() if f.assistant is not None)
    return _DRAFTER_KINDS + shipped


def assistant_titles() -> dict[str, str]:
    """The kinds of the assistants families ship beside their models (Gemma 4's) -> what messages call them."""
    return {f.assistant.kind: f.assistant.title for f in FAMILIES.values() if f.assistant is not None}


def drafters_beside(source: Path, extra: list[Path]) -> list[tuple[str, Path]]:
    """(kind, folder) for every drafter folder next to `source` (its siblings, and its own subfolders when it
    is a folder) and in `extra` (where our trainers write by default)."""
    parent = source.parent
    candidates = [*(p for p in sorted(parent.iterdir()) if p.is_dir() and p != source), *extra]
    if source.is_dir():
        candidates += sorted(p for p in source.iterdir() if p.is_dir())
    found = []
    for folder in dict.fromkeys(candidates):
        kind = drafter_kind(folder) if folder.is_dir() else None
        if kind is not None:
            found.append((kind, folder))
    return found


def ships_mtp(model: str | None) -> bool:
    """Whether `model` (a default name, a file or folder; None: the default target) holds MTP layers we run."""
    from specdecode.models.formats.default_models import DEFAULT_MODELS, DEFAULT_TARGET, status
    from specdecode.models.loader import resolve_source

    name = DEFAULT_TARGET if model is None else model
    if name in DEFAULT_MODELS and status(DEFAULT_MODELS[name]) != "assembled":
        return False  # the default models ship none; assembling one only to look would take a minute
    facts = survey(resolve_source(name, quiet=True))
    return facts.runs and facts.mtp_usable > 0
