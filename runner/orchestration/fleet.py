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
decode context, by the very functions the twin uses (costmodel/planspec.py `group_replica_model`,
`nominal_point`); a group the cost model refuses (a format its accelerator lacks without `emulated = true`,
a tp too small for the model) is an error here as in the twin. When a rehearsal scales a group of R planned
replicas down to n, each local replica carries R / n replicas' weight, so the groups' routing shares stay
the plan's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from mixfleet.costmodel.catalog import load_catalog
from mixfleet.costmodel.formats import formats
from mixfleet.costmodel.model import load_model_spec
from mixfleet.costmodel.planspec import group_replica_model, nominal_point
from mixfleet.costmodel.workload import load_workload
from mixfleet.policies.plan import EmbeddedPlan, GroupPlan, Plan

MODES = ("embedded", "sglang", "attach")
ENGINE_PRECISIONS = formats().engine_precisions     # data/precisions.toml
ENGINE_KV_DTYPES = formats().engine_kv_dtypes


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """One sampler group as the runner starts it."""

    name: str
    accelerator: str                      # the plan's accelerator (the Ray custom resource requested)
    precision: str                        # engine / SGLang weight precision
    kv_dtype: str
    kernel: str | None                    # embedded engine's matmul dtype (None: the precision's own)
    weight_noise: float                   # embedded engine's emulated kernel error (0 = off)
    replicas: int                         # replicas started (scaled down when embedded)
    planned_replicas: int                 # the plan's count
    min_replicas: int
    max_replicas: int
    tp: int                               # accelerators per replica (the Ray resource amount); 1 embedded
    capacity_tokens_per_s: float          # one replica's nominal throughput (routing weight)
    usd_per_hour: float                   # one replica's price
    usd_per_mtoken: float
    urls: tuple[str, ...] = ()            # "attach" mode: the replicas' base URLs
    dp_attention: int = 1                 # the plan's layout (SGLang --dp-size with --enable-dp-attention)
    ep: int = 1                           # the plan's expert-parallel size (SGLang --ep-size)

    def __post_init__(self) -> None:
        where = f"fleet group '{self.name}'"
        if self.precision not in ENGINE_PRECISIONS:
            raise ValueError(f"{where}: precision = {self.precision!r}; allowed: {', '.join(ENGINE_PRECISIONS)}")
        if self.kv_dtype not in ENGINE_KV_DTYPES:
            raise ValueError(f"{where}: kv_dtype = {self.kv_dtype!r}; allowed: {', '.join(ENGINE_KV_DTYPES)}")
        if self.replicas < 0:
            raise ValueError(f"{where}: replicas = {self.replicas}; allowed: >= 0")


@dataclass(frozen=True, kw_only=True)
class FleetSpec:
    mode: str                             # one of MODES
    groups: tuple[GroupSpec, ...]
    threads_per_replica: int = 1          # torch threads of one embedded sampler
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


def _nominal(plan: Plan) -> Callable[[GroupPlan], tuple[float, float, float, int]]:
    """(tokens/s, USD/hour, USD/Mtoken, GPUs) of one replica of a group, as the twin has them."""
    cat = load_catalog(plan.price_table or None).with_prices(plan.prices)
    model = load_model_spec(plan.model)
    workload = load_workload(plan.workload)

    def one(g: GroupPlan) -> tuple[float, float, float, int]:
        rm = group_replica_model(plan, g, model, cat, workload)
        tps, usd_m = nominal_point(rm, workload.mean_decode_context)
        return tps, float(rm.price_usd_per_hour), usd_m, int(rm.n_gpus)
    return one


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
    nominal = _nominal(plan)
    for g in plan.groups:
        tps, usd_h, usd_m, tp = nominal(g)
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
        groups.append(GroupSpec(name=g.name, accelerator=g.accelerator, precision=g.precision, kv_dtype=g.kv_dtype,
                                kernel=g.kernel or None, weight_noise=g.weight_noise, replicas=n,
                                planned_replicas=g.replicas, min_replicas=lo, max_replicas=hi, tp=tp,
                                capacity_tokens_per_s=tps, usd_per_hour=usd_h, usd_per_mtoken=usd_m, urls=urls,
                                dp_attention=g.dp_attention if mode == "sglang" else 1,
                                ep=g.ep if mode == "sglang" else 1))
        resources[g.accelerator] = resources.get(g.accelerator, 0.0) + hi * tp
    if sum(g.replicas for g in groups) == 0:
        raise ValueError(f"plan '{plan.name}': no sampler replica to start (every group scaled to 0)")
    return FleetSpec(mode=mode, groups=tuple(groups), threads_per_replica=emb.threads_per_replica,
                     resources=resources)
