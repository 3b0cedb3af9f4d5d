"""Replica rates for the twin: the cost model's ReplicaModel made fast to query per event, and a plan
turned into the world's setup (groups, trainer, workload; the priors, or a calibration's fitted values).

`TabulatedRates` evaluates the roofline once, vectorized, on a grid of batch sizes (every integer up
to the engine cap) x contexts (geometric), and interpolates linearly in context, so a rate change in
the event loop costs a lookup, not a numpy call (the lookup is twin.core.GridRates, compiled). Prefill
is tabulated the same way over (new tokens, cached context). `FixedRates` is a plain formula with
hand-computable numbers (tests, docs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from mixfleet.costmodel.plan.planspec import (
    ResolvedGroup,
    ResolvedSandbox,
    plan_catalog,
    resolve_groups,
    resolve_plan_sandbox,
    resolve_trainer,
)
from mixfleet.costmodel.specs.catalog import Catalog
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.costmodel.specs.workload import WorkloadSpec, load_workload
from mixfleet.costmodel.steptime.roofline import DEFAULT_MAX_BATCH, ReplicaModel
from mixfleet.policies.plan import Plan
from mixfleet.twin.core import GridRates
from mixfleet.twin.world import GroupSetup, TrainerSetup

if TYPE_CHECKING:
    from mixfleet.costmodel.calibration.record import Calibration


@dataclass(frozen=True, kw_only=True)
class FixedRates:
    """decode step = step_s + per_seq_s * batch + per_ctx_token_s * batch * context; prefill = per_token_s * tokens."""
    step_s: float = 0.01             # seconds per decode step at batch 0 (weights read)
    per_seq_s: float = 0.0           # extra seconds per step per running sequence
    per_ctx_token_s: float = 0.0     # extra seconds per step per KV token read
    prefill_per_token_s: float = 0.0
    kv_capacity_tokens: float = 1e12
    max_running: int = 1_000_000
    price_usd_per_hour: float = 1.0
    cold_start_s: float = 0.0

    def decode_step_s(self, batch: int, context_tokens: float) -> float:
        return self.step_s + self.per_seq_s * batch + self.per_ctx_token_s * batch * context_tokens

    def prefill_s(self, tokens: float) -> float:
        return self.prefill_per_token_s * tokens


class TabulatedRates(GridRates):
    """A ReplicaModel's decode/prefill times on grids, interpolated (within ~1% of the roofline); the lookups
    are `twin.core.GridRates`' (compiled with the replica, which reads them without a Python call)."""

    def __init__(self, rm: ReplicaModel, max_context: int, max_running: int = DEFAULT_MAX_BATCH,
                 grid_points: int = 48) -> None:
        self.model = rm
        self.kv_capacity_tokens = float(rm.kv_capacity_tokens)
        self.price_usd_per_hour = float(rm.price_usd_per_hour)
        self.cold_start_s = float(rm.cold_start_s)
        ctx = np.unique(np.geomspace(1, max(max_context, 2), grid_points).round())
        batch = np.arange(1, max_running + 1, dtype=np.float64)
        decode = np.asarray(rm.decode_step_s(batch[:, None], ctx[None, :]), dtype=np.float64).tolist()
        # new tokens on the same grid; per request, as the replica's DP ranks run it (`replica_prefill_s`)
        prefill = np.asarray(rm.replica_prefill_s(ctx), dtype=np.float64).tolist()
        self.set_grids(max_running, ctx.tolist(), decode, ctx.tolist(), prefill)


@dataclass(frozen=True, kw_only=True)
class Setup:
    groups: list[GroupSetup]
    trainer: TrainerSetup
    workload: WorkloadSpec
    models: dict[str, ReplicaModel]                      # per group: the replica model the world runs
    resolved: tuple[ResolvedGroup, ...] = ()             # per group: costmodel's record (planspec.resolve_groups)
    notes: tuple[str, ...] = ()                          # with a calibration: what it left at the priors, and why
    sandbox: ResolvedSandbox | None = None               # the plan's [sandbox] priced (None: no sandboxes)


def group_setup(r: ResolvedGroup, max_context: int, spot_preemptions_per_hour: float | None = None) -> GroupSetup:
    """The world's view of one resolved group (twin.world.GroupSetup): its rates tabulated up to the engine's
    running cap, its routing weight (the nominal point), weight sync and mismatch, as `r` has them; a spot group
    is preempted at `spot_preemptions_per_hour` (the plan's [faults] spot rate) or, None, the catalog's."""
    g = r.group
    spot_h = (r.spot_preemptions_per_hour if spot_preemptions_per_hour is None else spot_preemptions_per_hour
              ) if g.spot else 0.0
    return GroupSetup(
        name=g.name, rates=TabulatedRates(r.replica, max_context, r.max_running), replicas=g.replicas,
        min_replicas=g.min_replicas, max_replicas=g.max_replicas, capacity_tokens_per_s=r.capacity_tokens_per_s,
        usd_per_mtoken=r.usd_per_mtoken, weight_sync_s=r.weight_sync_s, kl_k3=r.kl_k3, extreme_share=r.extreme_share,
        kl_growth_per_version=r.kl_growth_per_staleness, preemptions_per_replica_hour=spot_h)


def build_setup(plan: Plan, *, price_table: str | None = None, catalog: Catalog | None = None,
                calibration: Calibration | None = None, use_workload: bool = True,
                workload: WorkloadSpec | None = None) -> Setup:
    """Everything the world needs from the cost model for `plan`: each group as `resolve_groups` prices it
    (the priors, or `calibration`'s fitted values for the groups it covers), the trainer as `resolve_trainer`
    does, and the workload (with a calibration: its measured workload unless `use_workload=False`; batch sizes
    and the context limit stay the plan's; `workload`, e.g. `mixfleet calibrate --workload-out`'s fit, in place of
    both, batch sizes and context limit again the plan's). Setup.notes says what a calibration left at the
    priors. The sandboxes are the plan's (`resolve_plan_sandbox`: a repo plan's pool, the start latency from the
    workload used when the plan does not set one)."""
    cat = catalog.with_prices(plan.prices) if catalog is not None else plan_catalog(plan, price_table)
    model = load_model_spec(plan.model)
    plan_wl = load_workload(plan.workload)
    given, workload = workload, plan_wl
    if calibration is not None and use_workload:
        workload = calibration.workload_spec(plan_wl) or plan_wl
    if given is not None:
        workload = replace(given, prompts_per_update=plan_wl.prompts_per_update,
                           samples_per_prompt=plan_wl.samples_per_prompt, max_context=plan_wl.max_context)
    resolved = resolve_groups(plan, calibration=calibration, catalog=cat, model=model, workload=plan_wl)
    trainer = resolve_trainer(plan.trainer.accelerator, plan.trainer.gpus, model=model, catalog=cat,
                              calibration=calibration)
    notes: list[str] = []
    if calibration is not None:
        if calibration.model and calibration.model != model.name:
            notes.append(f"calibrated on model {calibration.model}, plan runs {model.name}: the fitted factors are "
                         "applied as is")
        notes += [f"group {r.name}: not in the calibration (prior values)" for r in resolved if r.calibration is None]
        if trainer.calibration is None:
            notes.append(f"trainer {plan.trainer.accelerator} differs from the calibrated "
                         f"{calibration.trainer_accelerator}: its prior step time is used (a trainer fit applies to "
                         "the accelerator it was made on)")
    spot_h = plan.faults.spot_preemptions_per_replica_hour
    return Setup(groups=[group_setup(r, workload.max_context, spot_h) for r in resolved],
                 trainer=TrainerSetup(train_step_s=lambda tokens: float(trainer.step_s(tokens)),
                                      usd_per_hour=trainer.usd_per_hour),
                 workload=workload, models={r.name: r.replica for r in resolved}, resolved=resolved,
                 notes=tuple(notes), sandbox=resolve_plan_sandbox(plan, workload))
