"""`auto`: every drafter that exists for the target, with per-step choice and the speed guard.

The seed's advice as a rule: a model's own MTP layers first, then a drafter trained for it (EAGLE-3, DFlash,
DSpark), then a smaller model of the same family as a draft, with suffix lookups for text that repeats ahead of
them all (free to run, often right on code and edits). Per-step choice (`combine="best"`,
drafters/step_choice.py) and the speed guard settle which member drafts each step; adding a member cannot change
the output, only the speed.

One rule, in two halves, each declared by the drafters themselves, so a new drafter kind becomes a candidate by
declaring the `AutoMember` capability (capabilities.py): its `auto_rank` and, where the default does not fit,
`found_for`:
- before any weights load, `find_sources` names what to load for it: the draft model given, else an installed
  default model with the target's vocabulary and at most half its weights (models/pairing.py); for each drafter
  that reads weights of its own, the folder given (--draft-head METHOD=PATH; one bare path is an EAGLE-3 head),
  else the one `specdecode train` writes for this target by default, when it holds a trained drafter;
- once loaded, `AutoDrafter.members` keeps each registered drafter with an `auto_rank` whose `found_for` names
  what makes it usable with what was loaded, in rank order; `Engine.check_spec` puts them in `auto`'s place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.drafters.base import Drafter, DrafterResources
from specdecode.drafters.capabilities import AutoMember, StandsForOthers
from specdecode.drafters.registry import DRAFTERS, drafter_paths, register
from specdecode.models.formats.drafter_folder import holds_weights, trained_folder


@dataclass(frozen=True)
class AutoSources:
    """What to load for `auto`, decided before any weights load."""

    draft_model: str | None  # the draft model to load, or None
    draft_paths: dict[str, str] = field(default_factory=dict)  # drafter name -> the folder of its own weights
    found: tuple[str, ...] = ()  # what was found where, in words


def find_sources(target: str | None, draft_model: str | None, draft_head: str | None) -> AutoSources:
    """The draft model and drafter folders `auto` uses for `target` (None: the default target), given what the
    user named (--draft-model, --draft-head) and what is installed or trained."""
    from specdecode.models.pairing import sibling_draft

    given = drafter_paths(draft_head)
    paths = dict(given) if isinstance(given, dict) else ({} if given is None else {"eagle3": given})
    found = [f"{DRAFTERS[name].weights_kind} given at {path}" for name, path in paths.items() if name in DRAFTERS]
    for cls in _candidates():
        folder = trained_folder(cls.name, target)
        if cls.caps.draft_files and cls.name not in paths and holds_weights(folder):
            paths[cls.name] = str(folder)
            found.append(f"{cls.weights_kind} trained at {folder}")
    draft = draft_model or sibling_draft(target)
    if draft is not None:
        found.append(f"draft model {draft}{' given' if draft_model else ', installed, same vocabulary'}")
    return AutoSources(draft, paths, tuple(found))


@register
class AutoDrafter(Drafter, StandsForOthers):
    """A registered combination: it stands for the members found for the target (`stands_for`), so it never
    drafts itself; the engine runs those members with per-step choice."""

    name = "auto"
    finds_sources = True

    @classmethod
    def stands_for(cls, resources: DrafterResources) -> list[str]:
        return [name for name, _ in cls.members(resources)]

    @classmethod
    def members(cls, resources: DrafterResources) -> list[tuple[str, str]]:
        """(drafter name, what makes it usable) for every candidate that can draft with `resources`, in rank
        order."""
        chosen = []
        for candidate in _candidates():
            reason = candidate.found_for(resources)
            if reason is not None:
                chosen.append((candidate.name, reason))
        return chosen

    @classmethod
    def describe(cls, resources: DrafterResources) -> str:
        """One line: the members auto runs for these resources, and why each."""
        members = cls.members(resources)
        reasons = [f"{name}: {reason}" for name, reason in members]
        if len(members) <= 1:
            reasons.append("no MTP layers, trained drafter or draft model found for this target")
        chain = ",".join(name for name, _ in members)
        return f"auto: {chain} with per-step choice and the speed guard ({'; '.join(reasons)})"

    @classmethod
    def create(cls, resources: DrafterResources, options) -> Drafter:
        raise TypeError("'auto' stands for other drafters: Engine.check_spec replaces it with its members")

    def propose(self, seq, budget: int):
        raise TypeError("'auto' stands for other drafters: Engine.check_spec replaces it with its members")


def _candidates() -> list[type[AutoMember]]:
    members = (cls for cls in DRAFTERS.values() if issubclass(cls, AutoMember))
    return sorted(members, key=lambda cls: cls.auto_rank)
