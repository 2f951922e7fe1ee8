"""Method names -> drafter classes, their options, and the names other runtimes use for both.

Everything a front door needs about drafters comes from here: the CLI builds its flags from `all_options()`,
the server its `speculative` fields, the bench its method strings and `--speculative-config` its vLLM names,
so a new drafter's options are declared once, in its own file.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import Field, fields, replace
from typing import Any

from specdecode.config import SpecConfig
from specdecode.drafters import capabilities
from specdecode.drafters.base import Drafter, DrafterResources, check_bounds
from specdecode.errors import SpecDecodeError, quoted

DRAFTERS: dict[str, type[Drafter]] = {}


def register(cls: type[Drafter]) -> type[Drafter]:
    """Add a drafter class under its name; a class that leaves out a required method (base.Drafter) or a method
    of a capability it declares (capabilities.py) is refused here, not at its first step."""
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise TypeError(f"drafter {getattr(cls, 'name', cls.__name__)!r} does not implement {missing}")
    taken = all_options()
    for item in fields(cls.Options):
        if item.name in taken:  # option names are global (flags, JSON fields), so two drafters cannot share one
            raise ValueError(f"option {item.name!r} of {cls.name!r} is already an option of {taken[item.name][0].name!r}")
    DRAFTERS[cls.name] = cls
    return cls


def all_options() -> dict[str, tuple[type[Drafter], Field]]:
    """Option name -> (the drafter that declares it, its dataclass field)."""
    return {item.name: (cls, item) for cls in DRAFTERS.values() for item in fields(cls.Options)}


def with_serve_defaults(spec: SpecConfig) -> SpecConfig:
    """The spec with each option a server defaults differently (`serve_default`) set, unless given."""
    given = dict(spec.options)
    for name, (_, item) in all_options().items():
        if item.metadata["serve_default"] is not None and name not in given:
            given[name] = item.metadata["serve_default"]
    return replace(spec, options=given)


def canonical_method(name: str) -> str:
    """Our name for a method, given ours or another runtime's (llama.cpp's --spec-type, vLLM's method)."""
    for cls in DRAFTERS.values():
        if name in cls.aliases or name == cls.vllm_method:
            return cls.name
    return name


def resolve_spec(spec: SpecConfig) -> SpecConfig:
    """`spec` as the engine runs it, checked against the registry: method names as ours (another runtime's name
    for one is taken too), each option known and of a value its drafter accepts, the relaxed rule in its canonical
    form; a SpecDecodeError names the first thing wrong. Builds nothing."""
    from specdecode.acceptance.relaxed import Relaxed  # imports torch, which `specdecode models` does without

    resolved = replace(spec, method=",".join(canonical_method(m) for m in spec.methods),
                       relaxed=None if spec.relaxed is None else str(Relaxed.parse(spec.relaxed)))
    validate_method(resolved)
    check_options_given(dict(resolved.options))
    check_options(resolved)
    return resolved


def expand_spec(spec: SpecConfig, resources: DrafterResources) -> SpecConfig:
    """A resolved `spec` with every combination that stands for other drafters (`auto`) replaced by its members
    for `resources`, which then run with per-step choice (combine="best")."""
    names, combine = [], spec.combine
    for name in spec.methods:
        members = capabilities.stands_for(DRAFTERS[name], resources)
        if members is None:
            names.append(name)
        else:
            names.extend(members)
            combine = "best"
    return replace(spec, method=",".join(dict.fromkeys(names)), combine=combine)


def check_options_apply(methods: tuple[str, ...], names: Iterable[str]) -> None:
    """Each option named (given explicitly, by a user) is one that a drafter of `methods` reads: an option of
    another method would be silently ignored. A combination that finds its members (`auto`) may take an option
    of any drafter it may run."""
    users = {DRAFTERS[m] for m in methods if m in DRAFTERS}
    if any(capabilities.finds_sources(user) for user in users):
        users |= {cls for cls in DRAFTERS.values() if capabilities.auto_rank(cls) is not None}
    known = all_options()
    for name in names:
        if name in known and known[name][0] not in users:
            raise SpecDecodeError(f"option {name} belongs to method '{known[name][0].name}', which "
                                  f"'{','.join(methods)}' does not run", name)


def check_resources(spec: SpecConfig, resources: DrafterResources) -> None:
    """Whether what `spec`'s drafters need was loaded (a draft model, a folder of their own weights), and whether
    their options fit it, checked without building them; the message says which flag provides it."""
    for name in validate_method(spec):
        DRAFTERS[name].check_resources(resources, options_for(DRAFTERS[name], spec))


def check_options_given(given: dict[str, Any]) -> None:
    """Every option names a registered drafter's option and has a value that drafter accepts."""
    known = all_options()
    unknown = [name for name in given if name not in known]
    if unknown:
        raise SpecDecodeError(f"unknown speculative option {unknown[0]!r}; options: {', '.join(sorted(known))}")
    for cls in {known[name][0] for name in given}:
        _build_options(cls, given)


def validate_method(spec: SpecConfig) -> tuple[str, ...]:
    methods = spec.methods
    unknown = [m for m in methods if m not in DRAFTERS]
    if not methods or unknown:
        raise SpecDecodeError(
            f"unknown speculative method {quoted(spec.method)}; valid: {', '.join(sorted(DRAFTERS))} "
            "or a comma-separated combination such as 'ngram,draft'"
        )
    if "none" in methods and len(methods) > 1:  # a member that never drafts: the combination is its other members
        raise SpecDecodeError(f"method {quoted(spec.method)} combines 'none', which drafts nothing; leave it out "
                              f"('{','.join(m for m in methods if m != 'none')}')")
    return methods


def needs_draft_model(spec: SpecConfig) -> bool:
    """Whether any method of `spec` drafts with a draft model, so callers load one only when it is used."""
    return any(DRAFTERS[m].caps.needs_draft_model for m in validate_method(spec))


def needs_draft_files(spec: SpecConfig) -> bool:
    """Whether a method of `spec` reads its own weights from --draft-head PATH (an EAGLE-3 head), so callers
    pass the path instead of loading it as a model."""
    return any(DRAFTERS[m].caps.draft_files for m in validate_method(spec))


def with_own_weights() -> tuple[str, ...]:
    """The drafters that read weights of their own (caps.draft_files): the kinds `specdecode train` trains and
    `auto` and `inspect` look for where it writes them."""
    return tuple(name for name, cls in DRAFTERS.items() if cls.caps.draft_files)


def options_for(cls: type[Drafter], spec: SpecConfig) -> Any:
    """The drafter's own options from the spec (defaults for the rest), checked."""
    return _build_options(cls, dict(spec.options))


def _build_options(cls: type[Drafter], given: dict[str, Any]) -> Any:
    options = cls.Options(**{item.name: given[item.name] for item in fields(cls.Options) if item.name in given})
    for item in fields(options):
        value, kind = getattr(options, item.name), type(item.default)
        exact = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        widening = kind is float and isinstance(value, int) and not isinstance(value, bool)
        if not (exact or widening):
            raise SpecDecodeError(f"option {item.name} must be {kind.__name__}, got {value!r}")
    check_bounds(options)
    options.check()
    return options


def check_options(spec: SpecConfig) -> None:
    """The method and its options' values checked without building anything (before models load)."""
    for name in validate_method(spec):
        options_for(DRAFTERS[name], spec)


def member_key(cls: type[Drafter], spec: SpecConfig) -> tuple:
    """What makes two members of two specs the same drafter: its name and its own options' values."""
    options = options_for(cls, spec)
    return (cls.name, tuple(getattr(options, item.name) for item in fields(options)))


def create_member(cls: type[Drafter], spec: SpecConfig, resources: DrafterResources) -> Drafter:
    return cls.create(resources, options_for(cls, spec))


def drafter_paths(value: str | None) -> str | dict[str, str] | None:
    """--draft-head: one folder, or METHOD=PATH pairs (comma-separated) when several drafters read their own."""
    if value is None or "=" not in value:
        return value
    pairs = [part.partition("=") for part in value.split(",")]
    if not all(method in DRAFTERS and sep and path for method, sep, path in pairs):
        return value  # a folder whose name holds "=": taken as one path
    return {method: path for method, _, path in pairs}
