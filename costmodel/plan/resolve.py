"""A plan's groups and trainer resolved to what every world prices them with: "plan group -> replica cost
model" (`group_replica_model`, the one construction the twin, the planner, the runner's fleet and the
calibration share), the engine's running cap and nominal point (`running_cap`, `nominal_point`), the
calibration's match for a group (`group_calibration`), the one group record (`resolve_group`,
`resolve_groups`, `ResolvedGroup`: replica model prior or calibrated, weight-sync seconds, mismatch, running
cap, nominal point), the plan's catalog (`plan_catalog`), the trainer (`resolve_trainer`,
`ResolvedTrainer`) and the sandboxes (`resolve_sandbox`, `resolve_plan_sandbox`, `ResolvedSandbox`: cap, start
latency, price and its source). The plan's plain data these read is costmodel/plan/planspec.py, which re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import Accelerator, Catalog, load_catalog
from mixfleet.costmodel.specs.mismatch import mismatch_prior
from mixfleet.costmodel.specs.model import ModelSpec, load_model_spec
from mixfleet.costmodel.specs.workload import WorkloadSpec, load_workload
from mixfleet.costmodel.steptime.roofline import (
    DEFAULT_MAX_BATCH,
    ArrayLike,
    Efficiency,
    ReplicaModel,
    replica_model,
    trainer_step_s,
    weight_sync_s,
)

# Types of annotations only: costmodel.calibration imports planspec (it reads run logs' plans with its schema),
# and planspec imports this module (it re-exports it).
if TYPE_CHECKING:
    from mixfleet.costmodel.calibration.record import Calibration, GroupCalibration
    from mixfleet.costmodel.plan.planspec import GroupPlan, PlanData, SandboxPlan


# ---- plan group -> replica cost model -------------------------------------------------------------------
def group_replica_model(plan: PlanData, g: GroupPlan, model: ModelSpec, catalog: Catalog, workload: WorkloadSpec,
                        efficiency: Efficiency | None = None) -> ReplicaModel:
    """The cost model of one replica of a plan group, the one construction the twin, the planner, the runner's
    fleet (routing weights) and the calibration (priors) share: the group's accelerator, precision, KV dtype, tp
    (0 = the smallest that fits), layout and `emulated` flag, the plan's cost backend, a KV budget of one
    max-context sequence of the workload, and `efficiency` (calibrated factors) over the catalog's."""
    return _group_replica(g, model, catalog, workload, plan.cost_backend, efficiency)


def _group_replica(g: GroupPlan, model: ModelSpec, catalog: Catalog, workload: WorkloadSpec, backend: str,
                   efficiency: Efficiency | None = None) -> ReplicaModel:
    acc = catalog.spot(g.accelerator) if g.spot else g.accelerator   # a spot group pays the spot price
    return replica_model(model, acc, g.precision, g.kv_dtype, catalog=catalog, tp=g.tp or None,
                         emulated=g.emulated, efficiency=efficiency,
                         kv_budget_tokens=min(workload.max_context, model.max_context), layout=g.layout,
                         backend=backend)


def running_cap(rm: ReplicaModel) -> int:
    """The engine's cap on one replica's running requests: DEFAULT_MAX_BATCH per attention-DP rank (each rank
    runs its own scheduler). The twin's replicas, the routing weights and the planner's busy batch use it."""
    return DEFAULT_MAX_BATCH * rm.dp_attention


def nominal_point(rm: ReplicaModel, mean_context: float, max_running: int | None = None) -> tuple[float, float]:
    """A replica's serving capacity at the workload's mean decode context: (tokens/s, USD per Mtoken),
    at the largest batch its KV holds, capped at the engine's running limit (default: DEFAULT_MAX_BATCH per
    attention-DP rank). The routing weight of a group in both worlds."""
    cap = running_cap(rm) if max_running is None else max_running
    b = max(1, int(rm.max_batch(mean_context, cap)))
    tps = float(rm.tokens_per_s(b, mean_context))
    return tps, rm.price_usd_per_hour / 3600.0 / tps * 1e6



# ---- plan group -> everything a world prices it with ------------------------------------------------------
def group_calibration(calibration: Calibration | None, g: Any) -> GroupCalibration | None:
    """The calibration's fitted values for plan group `g` (a GroupPlan, or anything with its name, accelerator,
    precision, kv_dtype and kernel), the one matching rule of the twin and the planner: the calibrated group of
    the same name, else of the same (accelerator, precision, KV dtype, kernel), else, for a group with no kernel
    of its own (every planner candidate), of the same (accelerator, precision, KV dtype) under any kernel; None
    without a calibration or a match."""
    if calibration is None:
        return None
    found = calibration.group(g.name, (g.accelerator, g.precision, g.kv_dtype, g.kernel))
    if found is None and g.kernel == "":
        found = next((c for c in calibration.groups
                      if tuple(c.key[:3]) == (g.accelerator, g.precision, g.kv_dtype)), None)
    return found


@dataclass(frozen=True, kw_only=True)
class ResolvedGroup:
    """One plan group as every world prices it (`resolve_groups`): the group, one replica's cost model (the
    prior, or the prior through the calibration's `GroupCalibration.apply`), its weight-sync seconds and
    mismatch (each the prior or the fitted value), the engine's running cap and the nominal point (routing
    weight: the prior replica at the workload's mean decode context, what the real runner routes with)."""
    group: GroupPlan
    replica: ReplicaModel            # what the world runs: prior, or calibrated
    prior: ReplicaModel              # the cost model's prior (the nominal point's replica)
    calibration: GroupCalibration | None   # the matched fitted values (None: priors throughout)
    weight_sync_s: float             # seconds per push of a new version from the trainer
    kl_k3: float                     # mismatch vs the trainer at staleness 0 (per token)
    extreme_share: float             # share of tokens with a ratio outside [0.2, 5] (what the correction masks)
    kl_growth_per_staleness: float   # relative KL growth per version of staleness
    max_running: int                 # the engine's running-request cap of one replica (`running_cap`)
    capacity_tokens_per_s: float     # nominal point: one replica's tokens/s (routing weight)
    usd_per_mtoken: float            # nominal point: USD per generated Mtoken
    spot_preemptions_per_hour: float = 0.0   # a spot group's preemptions per replica-hour (the catalog's rate)

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def gpus(self) -> int:
        """GPUs of one replica (tp x dp_attention)."""
        return self.replica.n_gpus


def resolve_group(g: GroupPlan, *, model: ModelSpec, workload: WorkloadSpec, catalog: Catalog, backend: str,
                  trainer_accelerator: Accelerator, calibration: Calibration | None = None) -> ResolvedGroup:
    """`ResolvedGroup` of one group (the planner's candidates come here one by one; `resolve_groups` does a
    plan's). A group the cost model refuses (does not fit, an emulated format without `emulated`) raises."""
    prior = _group_replica(g, model, catalog, workload, backend)
    gc = group_calibration(calibration, g)
    mm = mismatch_prior(g.accelerator, g.precision, g.kv_dtype)
    cap = running_cap(prior)
    tps, usd_mtok = nominal_point(prior, workload.mean_decode_context, cap)
    spot_h = catalog.spot(g.accelerator).spot_preemptions_per_hour if g.spot else 0.0
    if gc is None:
        return ResolvedGroup(group=g, replica=prior, prior=prior, calibration=None,
                             weight_sync_s=weight_sync_s(prior, trainer_accelerator), kl_k3=mm.kl_k3,
                             extreme_share=mm.extreme_share, kl_growth_per_staleness=mm.growth_per_staleness,
                             max_running=cap, capacity_tokens_per_s=tps, usd_per_mtoken=usd_mtok,
                             spot_preemptions_per_hour=spot_h)
    return ResolvedGroup(group=g, replica=gc.apply(prior), prior=prior, calibration=gc,
                         weight_sync_s=gc.weight_sync_s.value, kl_k3=gc.kl_k3.value,
                         extreme_share=gc.extreme_share.value, kl_growth_per_staleness=gc.kl_growth_per_staleness.value,
                         max_running=cap, capacity_tokens_per_s=tps, usd_per_mtoken=usd_mtok,
                         spot_preemptions_per_hour=spot_h)


def plan_catalog(plan: PlanData, price_table: str | None = None) -> Catalog:
    """The catalog a plan is priced with: its price table (or `price_table`) under its `[prices]`."""
    return load_catalog(price_table or plan.price_table or None).with_prices(plan.prices)


def resolve_groups(plan: PlanData, *, calibration: Calibration | None = None, catalog: Catalog | None = None,
                   model: ModelSpec | None = None, workload: WorkloadSpec | None = None) -> tuple[ResolvedGroup, ...]:
    """Every group of `plan` as `ResolvedGroup`s, in the plan's order: the one derivation of a group's replica
    model, weight-sync seconds, mismatch, running cap and nominal point, for the twin's setup (calibrated or
    not) and the planner. `calibration`: fitted values for the groups it covers (`group_calibration`); the
    others keep the priors. `catalog`: default the plan's (`plan_catalog`); model / workload: the plan's."""
    cat = catalog if catalog is not None else plan_catalog(plan)
    spec = model if model is not None else load_model_spec(plan.model)
    wl = workload if workload is not None else load_workload(plan.workload)
    trainer_acc = cat.accelerator(plan.trainer.accelerator)
    return tuple(resolve_group(g, model=spec, workload=wl, catalog=cat, backend=plan.cost_backend,
                               trainer_accelerator=trainer_acc, calibration=calibration) for g in plan.groups)


@dataclass(frozen=True, kw_only=True)
class ResolvedTrainer:
    """The trainer as every world prices it (`resolve_trainer`): its step time (the calibration's fit when
    the calibration was made on this accelerator, else the roofline prior) and its USD per hour."""
    model: ModelSpec
    accelerator: Accelerator
    gpus: int
    catalog: Catalog
    usd_per_hour: float
    calibration: Calibration | None  # the calibration whose trainer fit applies (None: the prior)

    def step_s(self, tokens: ArrayLike) -> ArrayLike:
        """Seconds of one update's train step over `tokens` generated tokens."""
        if self.calibration is not None:
            return self.calibration.trainer_step_s(self.model, self.catalog, self.gpus, tokens)
        return trainer_step_s(self.model, self.accelerator, self.gpus, tokens)


def resolve_trainer(accelerator: str, gpus: int, *, model: ModelSpec, catalog: Catalog,
                    calibration: Calibration | None = None) -> ResolvedTrainer:
    """The trainer on `gpus` GPUs of `accelerator`; a calibration's trainer fit applies only to the
    accelerator it was made on (a fit on another one keeps the prior: the twin, the planner's screen and its
    verification alike)."""
    from mixfleet.costmodel.records.ledger import trainer_usd_per_hour  # ledger reads run logs: not at import

    acc = catalog.accelerator(accelerator)
    fit = calibration if calibration is not None and calibration.trainer_accelerator == acc.name else None
    return ResolvedTrainer(model=model, accelerator=acc, gpus=gpus, catalog=catalog, calibration=fit,
                           usd_per_hour=trainer_usd_per_hour(acc.price_usd_per_gpu_hour, gpus))


# ---- sandboxes ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ResolvedSandbox:
    """A plan's sandboxes as a world runs them: the pool's cap, the start latency and the price per hour, with
    where the price comes from."""
    max_live: int
    start_s: float
    usd_per_hour: float
    price_source: str


def resolve_sandbox(sb: SandboxPlan | None, catalog_sandbox: Any = None,
                    workload: WorkloadSpec | None = None) -> ResolvedSandbox | None:
    """The plan's [sandbox] with its price: its own `price_per_hour_usd`, else the catalog's [sandbox] price
    (`catalog.sandbox_price()`, or `catalog_sandbox` when given), and its start latency: its own `start_s`, else
    the mean of `workload`'s `sandbox_start_s` when it has one (`mixfleet calibrate --workload-out` measures
    it), else 0. None for a plan without sandboxes."""
    if sb is None:
        return None
    start = sb.start_s
    if start is None:
        ws = workload.sandbox_start_s if workload is not None else None
        start = float(ws.mean) if ws is not None else 0.0
    if sb.price_per_hour_usd is not None:
        src = f"the plan's [sandbox] ({sb.source or 'no source given'}" + (f", {sb.date})" if sb.date else ")")
        return ResolvedSandbox(max_live=sb.max_live, start_s=float(start),
                               usd_per_hour=float(sb.price_per_hour_usd), price_source=src)
    from mixfleet.costmodel.specs.catalog import sandbox_price

    price = catalog_sandbox or sandbox_price()
    if price is None:
        raise SpecError("plan sandbox", "price_per_hour_usd", None, "a price (the catalog has no [sandbox] price)")
    return ResolvedSandbox(max_live=sb.max_live, start_s=float(start), usd_per_hour=price.usd_per_hour,
                           price_source=f"{price.provider}, {price.vcpus:g} vCPU + {price.memory_gib:g} GiB; "
                                        f"{price.source}; {price.date}")


def resolve_plan_sandbox(plan: PlanData, workload: WorkloadSpec | None = None,
                         catalog_sandbox: Any = None) -> ResolvedSandbox | None:
    """`resolve_sandbox` of `plan_sandbox(plan)`: the sandboxes a world runs for `plan` with `workload`."""
    from mixfleet.costmodel.plan.planspec import plan_sandbox  # planspec imports this module at its top

    return resolve_sandbox(plan_sandbox(plan), catalog_sandbox, workload)
