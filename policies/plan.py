"""The Plan: which sampler groups (accelerator x precision x KV dtype, replicas), which trainer, which
policies with which settings, on which model and workload. One TOML file; the twin simulates it, the
runner runs it, the planner writes it.

The plain data (groups, trainer, faults, embedded settings, model, workload, prices; the file format with
its `base` variants and `merge()`) lives in costmodel/plan/planspec.py, which documents the schema and checks
every field at load; this module adds what needs the policies: `[policies.<kind>]` checked against the
registry, `Plan.build_policies`, `with_overrides(plan, {"groups.H100-FP8.replicas": 4})`, and it
re-exports the plain-data names, so `from mixfleet.policies.plan import GroupPlan, load_plan` keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.paths import confined_spec
from mixfleet.costmodel.plan.planspec import (  # noqa: F401 - re-exported: the plan's plain data
    COST_BACKENDS,
    LOSSES,
    ON_LOSS,
    ROUTING_MODES,
    EmbeddedPlan,
    FaultsPlan,
    GroupPlan,
    PlanData,
    TrainerPlan,
    _resolve,
    known_plans,
    load_plan_dict,
    merge,
    plan_data_fields,
)
from mixfleet.costmodel.specs.workload import load_workload
from mixfleet.policies import registry

SPEC_FOLDERS = {"model": "models", "workload": "workloads"}   # plan fields naming a spec -> shipped data folder
DEFAULT_POLICIES = {"router": "capacity_proportional", "autoscaler": "fixed", "batcher": "fifo",
                    "weight_sync": "in_flight"}


@dataclass(frozen=True, kw_only=True)
class PolicyRef:
    """A registered policy and its settings."""
    name: str
    settings: dict[str, Any] = field(default_factory=dict)

    def build(self, kind: str) -> Any:
        return registry.make(kind, self.name, self.settings)


@dataclass(frozen=True, kw_only=True)
class PoliciesPlan:
    router: PolicyRef = field(default_factory=lambda: PolicyRef(name=DEFAULT_POLICIES["router"]))
    autoscaler: PolicyRef = field(default_factory=lambda: PolicyRef(name=DEFAULT_POLICIES["autoscaler"]))
    batcher: PolicyRef = field(default_factory=lambda: PolicyRef(name=DEFAULT_POLICIES["batcher"]))
    weight_sync: PolicyRef = field(default_factory=lambda: PolicyRef(name=DEFAULT_POLICIES["weight_sync"]))

    def __post_init__(self) -> None:
        for kind in registry.KINDS:  # validate names and settings now, not when the run starts
            ref = getattr(self, kind)
            registry.make_config(kind, ref.name, ref.settings)


@dataclass(frozen=True, kw_only=True)
class Plan(PlanData):
    """The plan: its plain data (costmodel/plan/planspec.py) and its policies."""
    policies: PoliciesPlan = field(default_factory=PoliciesPlan)

    def build_policies(self, workload: Any = None) -> dict[str, Any]:
        """Fresh policy objects: {"router": ..., "autoscaler": ..., "batcher": ..., "weight_sync": ...}.
        Batcher settings the plan leaves out come from the workload (costmodel WorkloadSpec; default: the
        plan's own `workload`): prompts_per_update, samples_per_prompt, and inflight_prompts = 4 x
        prompts_per_update. Both worlds build their policies here, so a plan has one update shape."""
        if workload is None:
            workload = load_workload(self.workload)
        out = {kind: getattr(self.policies, kind).build(kind) for kind in registry.KINDS}
        ref = self.policies.batcher
        ppu = ref.settings.get("prompts_per_update", workload.prompts_per_update)
        settings = {"prompts_per_update": ppu, "samples_per_prompt": workload.samples_per_prompt,
                    "inflight_prompts": 4 * ppu, **ref.settings}
        out["batcher"] = registry.make("batcher", ref.name, settings)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain TOML-ready dict (None values omitted)."""
        return self._to_dict({k: {"name": getattr(self.policies, k).name, **getattr(self.policies, k).settings}
                              for k in registry.KINDS})


# ---- building from dicts ------------------------------------------------------------------------------
def plan_from_dict(raw: dict[str, Any]) -> Plan:
    """Validate a plan table (after base merging) and build the Plan."""
    kwargs, pol_raw = plan_data_fields(raw, [f.name for f in fields(Plan)])
    where = f"plan '{kwargs['name']}'"
    for kind in pol_raw:
        if kind not in registry.KINDS:
            raise SpecError(f"{where} policies", kind, pol_raw[kind], registry.KINDS)
    refs = {}
    for kind in registry.KINDS:
        table = pol_raw.get(kind, {})
        if not isinstance(table, dict):
            raise SpecError(f"{where} policies", kind, table, f"a table [policies.{kind}] with a name")
        table = dict(table)
        refs[kind] = PolicyRef(name=table.pop("name", DEFAULT_POLICIES[kind]), settings=table)
    return Plan(**kwargs, policies=PoliciesPlan(**refs))


def with_overrides(plan: Plan, overrides: dict[str, Any]) -> Plan:
    """A variant: dotted keys, `groups.<name>.<field>` for a group (e.g. {"policies.router.name": "cost_aware"})."""
    over: dict[str, Any] = {}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if parts[0] == "groups":
            if len(parts) != 3:
                raise SpecError("override", dotted, value, "groups.<group name>.<field>")
            plan.group(parts[1])  # names the known groups if it is not one
            over.setdefault("groups", []).append({"name": parts[1], parts[2]: value})
            continue
        node = over
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return plan_from_dict(merge(plan.to_dict(), over))


# ---- files ----------------------------------------------------------------------------------------------
def load_plan(path: str | Path, *, roots: Sequence[Path] = ()) -> Plan:
    """Load a plan by path or shipped name (e.g. "seed-mixed"), resolving `base` variants.

    Every path the plan names follows the rule of `base`: its `model` and `workload` are shipped names or .toml
    files inside the plan's own folder (or one of `roots`), taken relative to that folder and kept as absolute
    paths in the Plan (`costmodel.paths.confined_spec`); anything else is a SpecError naming the field."""
    file = Path(path) if Path(path).is_file() else _resolve(str(path), None)
    raw = load_plan_dict(file)
    where = f"plan '{raw.get('name', file.name)}' ({file})"
    for key, folder in SPEC_FOLDERS.items():
        if key in raw:
            raw[key] = confined_spec(folder, raw[key], key, where=where, near=file.parent, roots=roots,
                                     not_this=file)
    return plan_from_dict(raw)


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write the plan as TOML (a complete file, no `base`)."""
    path = Path(path)
    path.write_text(tomli_w.dumps(plan.to_dict()))
    return path
