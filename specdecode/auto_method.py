"""`--spec-type auto`: the seed's advice as a rule, decided before any weights load.

The seed's order: a model's own MTP layers first, then an EAGLE-3 head trained for it, then a smaller model of
the same family as a draft, and n-gram/suffix lookups for text that repeats. `auto` takes every drafter it can
find for the target, puts `suffix` first (free to run, often right on code and edits), and lets per-step
choice (`combine=best`, drafters/step_choice.py) and the speed guard settle which one drafts each step; adding
a member cannot make the output differ, only the speed.

Where it looks:
- an EAGLE-3 head: --draft-head, else the folder `specdecode train eagle3` writes by default for this target
  (head_folder below);
- a draft model: --draft-model, else the smallest assembled default model with the target's vocabulary and at
  most half its weights (the pairing rule of `specdecode models --drafts-for`); for the default target, the
  default draft whenever its package is installed;
- MTP layers: in the target's own weights (models/survey.py reads its config and tensor names), in a companion
  file beside a GGUF target, or named with --draft-head mtp=PATH.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdecode.models.formats.default_models import DEFAULT_TARGET, cache_dir

LOOKUP = "suffix"  # measured ahead of ngram on HumanEval and repeated work (docs/benchmarks, 2026-12-01-suffix)


@dataclass(frozen=True)
class AutoChoice:
    method: str  # a chain for SpecConfig, e.g. "suffix,eagle3,draft"
    draft_model: str | None  # the draft model to load, or None
    draft_head: str | None  # the EAGLE-3 head folder, METHOD=PATH pairs (as --draft-head), or None
    reason: str  # one line: what was found and why

    def line(self) -> str:
        return f"auto: {self.method} with per-step choice and the speed guard ({self.reason})"


def model_label(target: str) -> str:
    """A target's short name: a default name as is, a .gguf file's stem, a folder's name."""
    path = Path(target)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def head_folder(target: str | None) -> Path:
    """Where `specdecode train eagle3` writes a head for `target` by default, and where auto looks for one."""
    return cache_dir() / "eagle3" / model_label(target or DEFAULT_TARGET)


def mtp_folder(target: str | None) -> Path:
    """Where `specdecode train mtp` writes the target with its trained MTP layers by default."""
    return cache_dir() / "mtp" / model_label(target or DEFAULT_TARGET)


def dflash_folder(target: str | None) -> Path:
    """Where `specdecode train dflash` writes a DFlash drafter for `target` by default."""
    return cache_dir() / "dflash" / model_label(target or DEFAULT_TARGET)


def dspark_folder(target: str | None) -> Path:
    """Where `specdecode train dspark` writes a DSpark drafter for `target` by default."""
    return cache_dir() / "dspark" / model_label(target or DEFAULT_TARGET)


def features_folder(target: str | None) -> Path:
    """Where `specdecode train` keeps the target's features by default, shared by every drafter kind."""
    return cache_dir() / "features" / model_label(target or DEFAULT_TARGET)


def choose(target: str | None, draft_model: str | None, draft_head: str | None) -> AutoChoice:
    """The drafters for `target` (None: the default target) given what the user named and what is installed.
    draft_head: one EAGLE-3 head folder, or METHOD=PATH pairs (an EAGLE-3 head, an MTP companion file)."""
    from specdecode.drafters.registry import drafter_paths
    from specdecode.models.survey import ships_mtp

    given = drafter_paths(draft_head)
    pairs = dict(given) if isinstance(given, dict) else None
    members, found = [LOOKUP], []
    if pairs is not None and "mtp" in pairs:
        members.append("mtp")
        found.append(f"MTP layers given at {pairs['mtp']}")
    elif ships_mtp(target):
        members.append("mtp")
        found.append("the target ships MTP layers")
    named = pairs.get("eagle3") if pairs is not None else given
    head = named or _trained_head(target)
    if head is not None:
        members.append("eagle3")
        found.append(f"EAGLE-3 head {'given' if named else 'found'} at {head}")
    if pairs is not None and head is not None:
        pairs["eagle3"] = head
    head = ",".join(f"{method}={path}" for method, path in pairs.items()) if pairs else head
    draft = draft_model or _installed_sibling(target)
    if draft is not None:
        members.append("draft")
        found.append(f"draft model {draft}{' given' if draft_model else ', installed, same vocabulary'}")
    if len(members) == 1:
        found.append("no MTP layers, EAGLE-3 head or draft model found for this target")
    found.append(f"{LOOKUP} for text that repeats")
    return AutoChoice(",".join(members), draft, head, "; ".join(found))


def _trained_head(target: str | None) -> str | None:
    folder = head_folder(target)
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return str(folder)
    return None


def _installed_sibling(target: str | None) -> str | None:
    from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_MODELS, status
    from specdecode.models.pairing import MAX_USEFUL_RATIO, installed_defaults, model_facts, pair

    installed = installed_defaults()
    if target is None:  # the default pair was chosen together
        return DEFAULT_DRAFT if DEFAULT_DRAFT in installed else None
    # Only defaults already assembled: auto is the default method, and checking a pairing must not assemble a
    # gigabyte file from its package before every run of another model (`specdecode models --drafts-for` does).
    ready = [name for name in installed if name != target and name in DEFAULT_MODELS
             and status(DEFAULT_MODELS[name]) == "assembled"]
    if not ready:
        return None
    facts = model_facts(target)
    usable = [p for p in (pair(facts, model_facts(name)) for name in ready)
              if p.can_draft and p.ratio <= MAX_USEFUL_RATIO]
    return min(usable, key=lambda p: p.ratio).candidate.name if usable else None
