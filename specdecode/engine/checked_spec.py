"""A spec checked once: method names resolved (another runtime's names taken), options checked against the
registry, `auto` replaced by the drafters found for what was loaded, and those drafters' needs met by it. The
front doors check a request's spec once (Engine.check_spec) and hand the result on; every later step of that
request (its KV cache's size, its drafter, begin) takes it as it is."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields

from specdecode.config import SpecConfig
from specdecode.drafters import DrafterResources
from specdecode.drafters.registry import check_options_apply, check_resources, expand_spec, resolve_spec


class CheckedSpec(SpecConfig):
    """A SpecConfig as one Engine runs it (made by `check`, never by hand); `checked_by` names that Engine."""

    # id() of the Engine whose resources it was checked against; 0 on a copy dataclasses.replace made (its fields
    # may differ from what was checked), which Engine.check_spec then checks again.
    checked_by: int = 0


def check(spec: SpecConfig, resources: DrafterResources, checked_by: int, given: Iterable[str] = ()) -> CheckedSpec:
    """`spec` resolved, expanded and checked against `resources` (building nothing, safe from any thread); `given`:
    the drafter options a user named, each of which must belong to a method the spec runs (before `auto` is
    expanded: it may take any of its members'). A SpecDecodeError says what is wrong."""
    resolved = resolve_spec(spec)
    check_options_apply(resolved.methods, given)
    expanded = expand_spec(resolved, resources)
    check_resources(expanded, resources)
    checked = object.__new__(CheckedSpec)
    for item in fields(SpecConfig):
        object.__setattr__(checked, item.name, getattr(expanded, item.name))
    object.__setattr__(checked, "checked_by", checked_by)
    return checked
