"""A registry of policy classes by name, one per kind (router, autoscaler, batcher, weight_sync).

Subclasses register with `@register("router", "capacity_proportional")`; a plan names them and
`make("router", name, settings)` builds one from its settings table. Unknown names and settings are
refused with the known ones listed, so a plan file with a typo fails before anything runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from mixfleet.costmodel.errors import SpecError

KINDS = ("router", "autoscaler", "batcher", "weight_sync")
_REGISTRY: dict[str, dict[str, type]] = {kind: {} for kind in KINDS}


def register(kind: str, name: str) -> Callable[[type], type]:
    """Class decorator: make `cls` available as policy `name` of `kind`. The class must define
    `Config` (a frozen kw-only dataclass of its settings) and take it as its only constructor argument."""
    if kind not in _REGISTRY:
        raise SpecError("policy registry", "kind", kind, KINDS)

    def deco(cls: type) -> type:
        cls.name = name
        cls.kind = kind
        _REGISTRY[kind][name] = cls
        return cls

    return deco


def names(kind: str) -> list[str]:
    """The registered policy names of one kind."""
    if kind not in _REGISTRY:
        raise SpecError("policy registry", "kind", kind, KINDS)
    return sorted(_REGISTRY[kind])


def policy_class(kind: str, name: str) -> type:
    """The class registered as `name` of `kind` (error lists the known names)."""
    if name not in _REGISTRY.get(kind, {}):
        raise SpecError(f"policies.{kind}", "name", name, names(kind))
    return _REGISTRY[kind][name]


def make_config(kind: str, name: str, settings: dict[str, Any] | None = None) -> Any:
    """Validate `settings` against the policy's Config dataclass and build it."""
    cls = policy_class(kind, name)
    settings = dict(settings or {})
    known = [f.name for f in dataclasses.fields(cls.Config)]
    for key in settings:
        if key not in known:
            raise SpecError(f"policies.{kind} ({name})", key, settings[key],
                            "a setting of this policy: " + (", ".join(known) or "(none)"))
    return cls.Config(**settings)


def make(kind: str, name: str, settings: dict[str, Any] | None = None) -> Any:
    """Build policy `name` of `kind` configured by `settings` (a plain dict, e.g. from a plan)."""
    return policy_class(kind, name)(make_config(kind, name, settings))
