"""A plan's sampler groups -> the concrete sampler replicas a run starts (or attaches to).

Three ways a group becomes replicas:
- "embedded" (`mixfleet run --embedded`, and any plan on a machine without its accelerators): each
  group becomes `min(replicas, embedded.max_replicas_per_group)` embedded samplers (runner/engine +
  runner/server) in the group's own weight precision, KV dtype and kernel. Replica counts are scaled
  down to fit the local machine; the policies, routing weights and run log are the plan's.
- "sglang": each replica is a real SGLang server launched with the group's flags
  (runner/sampler/sglang_launch.py) by a Ray actor placed on a node carrying the group's accelerator.
- "attach": replicas already serving at given URLs (`attach={"H100-FP8": ["http://..."]}`). Attaching one is
  a start like any other (runner/orchestration/sampler_fleet.py `_attach`: health, model, the run's weights
  loaded), so a URL that never passes fails the run or, allowed, loses its group.

Routing weights: capacity-proportional routing needs each group's serving capacity. It comes from the
cost model for the plan's accelerator / precision / KV dtype / tp / emulated flag at the workload's mean
decode context, from the record the twin uses (costmodel/plan/resolve.py `resolve_groups`: the prior replica's
`nominal_point`); a group the cost model refuses (a format its accelerator lacks without `emulated = true`,
a tp too small for the model) is an error here as in the twin. When a rehearsal scales a group of R planned
replicas down to n, each local replica carries R / n replicas' weight, so the groups' routing shares stay
the plan's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixfleet.costmodel.plan.planspec import ResolvedGroup, resolve_groups
from mixfleet.costmodel.specs.formats import formats
from mixfleet.policies.plan import EmbeddedPlan, Plan
from mixfleet.runner.sampler.replica import ReplicaLaunch

MODES = ("embedded", "sglang", "attach")
ENGINE_PRECISIONS = formats().engine_precisions     # data/precisions.toml
ENGINE_KV_DTYPES = formats().engine_kv_dtypes


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One sampler group as the runner starts it: the plan's resolved group (`planspec.resolve_groups`: the
    group, its replica model and nominal point) and what this run makes of it in its fleet mode. The group's
    own fields are read through it (`name`, `precision`, ...), never copied."""

    resolved: ResolvedGroup
    mode: str                             # the fleet's mode (MODES)
    replicas: int                         # replicas started (scaled down when embedded)
    min_replicas: int
    max_replicas: int
    tp: int                               # accelerators per replica (the Ray resource amount); 1 embedded
    capacity_tokens_per_s: float          # one replica's routing weight (the nominal point; x R / n scaled down)
    urls: tuple[str, ...] = ()            # "attach" mode: the replicas' base URLs

    def __post_init__(self) -> None:
        where = f"fleet group '{self.name}'"
        if self.precision not in ENGINE_PRECISIONS:
            raise ValueError(f"{where}: precision = {self.precision!r}; allowed: {', '.join(ENGINE_PRECISIONS)}")
        if self.kv_dtype not in ENGINE_KV_DTYPES:
            raise ValueError(f"{where}: kv_dtype = {self.kv_dtype!r}; allowed: {', '.join(ENGINE_KV_DTYPES)}")
        if self.replicas < 0:
            raise ValueError(f"{where}: replicas = {self.replicas}; allowed: >= 0")

    # the plan group's own fields, read through the resolved group
    @property
    def name(self) -> str:
        return self.resolved.group.name

    @property
    def accelerator(self) -> str:
        """The plan's accelerator (the Ray custom resource a replica requests)."""
        return self.resolved.group.accelerator

    @property
    def precision(self) -> str:
        return self.resolved.group.precision

    @property
    def kv_dtype(self) -> str:
        return self.resolved.group.kv_dtype

    @property
    def kernel(self) -> str | None:
        """The embedded engine's matmul dtype (None: the precision's own)."""
        return self.resolved.group.kernel or None

    @property
    def weight_noise(self) -> float:
        return self.resolved.group.weight_noise

    @property
    def planned_replicas(self) -> int:
        return self.resolved.group.replicas

    @property
    def dp_attention(self) -> int:
        """The plan's attention-DP size where SGLang serves the layout; 1 for an embedded replica."""
        return self.resolved.group.dp_attention if self.mode == "sglang" else 1

    @property
    def ep(self) -> int:
        return self.resolved.group.ep if self.mode == "sglang" else 1

    @property
    def usd_per_hour(self) -> float:
        """One replica's price."""
        return float(self.resolved.prior.price_usd_per_hour)

    @property
    def usd_per_mtoken(self) -> float:
        return self.resolved.usd_per_mtoken

    def launch(self, *, index: int, **replica: Any) -> ReplicaLaunch:
        """The launch record of replica `index` of this group: the group's serving settings, and the replica's
        own (`replica`: seed, threads, model_path / weights, weight_version, api_key, ...; ReplicaLaunch)."""
        return ReplicaLaunch(group=self.name, index=index, mode="sglang" if self.mode == "sglang" else "embedded",
                             precision=self.precision, kv_dtype=self.kv_dtype, kernel=self.kernel,
                             weight_noise=self.weight_noise, tp=self.tp, dp_attention=self.dp_attention, ep=self.ep,
                             **replica)


@dataclass(frozen=True, kw_only=True)
class FleetSpec:
    mode: str                             # one of MODES
    groups: tuple[GroupSpec, ...]
    resources: dict[str, float] = field(default_factory=dict)  # local Ray: custom resources to declare

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"fleet mode = {self.mode!r}; allowed: {', '.join(MODES)}")

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"fleet group {name!r}; known: {', '.join(g.name for g in self.groups)}")

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    @property
    def total_replicas(self) -> int:
        return sum(g.replicas for g in self.groups)


def fleet_from_plan(plan: Plan, *, mode: str = "embedded", attach: Mapping[str, Sequence[str]] | None = None,
                    max_replicas_per_group: int | None = None) -> FleetSpec:
    """The replicas a run of `plan` starts in `mode` (see the module doc)."""
    if mode not in MODES:
        raise ValueError(f"fleet mode = {mode!r}; allowed: {', '.join(MODES)}")
    emb = plan.embedded or EmbeddedPlan()
    cap = max_replicas_per_group if max_replicas_per_group is not None else emb.max_replicas_per_group
    attach = dict(attach or {})
    for name in attach:
        plan.group(name)                                   # unknown names -> SpecError listing the groups
    groups = []
    resources: dict[str, float] = {}
    for r in resolve_groups(plan):
        g = r.group
        tps, tp = r.capacity_tokens_per_s, int(r.gpus)
        urls = tuple(attach.get(g.name, ()))
        if mode == "embedded":
            n = min(g.replicas, cap)
            lo, hi, tp = min(g.min_replicas or 0, n), min(max(g.max_replicas or n, n), cap), 1
            if n > 0:                  # a scaled-down group keeps the plan's share of the routing weight
                tps *= g.replicas / n
        elif mode == "attach":
            if not urls and g.replicas > 0:
                raise ValueError(f"fleet group '{g.name}': mode 'attach' needs its URLs (attach={{'{g.name}': "
                                 f"['http://host:port', ...]}})")
            n, lo, hi = len(urls), len(urls), len(urls)
        else:
            n, lo, hi = g.replicas, g.min_replicas or 0, g.max_replicas or g.replicas
        groups.append(GroupSpec(resolved=r, mode=mode, replicas=n, min_replicas=lo, max_replicas=hi, tp=tp,
                                capacity_tokens_per_s=tps, urls=urls))
        resources[g.accelerator] = resources.get(g.accelerator, 0.0) + hi * tp
    if sum(g.replicas for g in groups) == 0:
        raise ValueError(f"plan '{plan.name}': no sampler replica to start (every group scaled to 0)")
    return FleetSpec(mode=mode, groups=tuple(groups), resources=resources)
