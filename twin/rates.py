"""Replica rates for the twin: the cost model's ReplicaModel made fast to query per event, and a plan
turned into the world's setup (groups, trainer, workload, priors).

`TabulatedRates` evaluates the roofline once, vectorized, on a grid of batch sizes (every integer up
to the engine cap) x contexts (geometric), and interpolates linearly in context, so a rate change in
the event loop costs a lookup, not a numpy call (the lookup is twin.core.GridRates, compiled). Prefill
is tabulated the same way over (new tokens, cached context). `FixedRates` is a plain formula with
hand-computable numbers (tests, docs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from mixfleet.costmodel.catalog import Catalog, load_catalog
from mixfleet.costmodel.ledger import trainer_usd_per_hour
from mixfleet.costmodel.mismatch import mismatch_prior
from mixfleet.costmodel.model import load_model_spec
from mixfleet.costmodel.planspec import group_replica_model, nominal_point
from mixfleet.costmodel.roofline import (
    DEFAULT_MAX_BATCH,
    Efficiency,
    ReplicaModel,
    trainer_step_s,
    weight_sync_s,
)
from mixfleet.costmodel.workload import WorkloadSpec, load_workload
from mixfleet.policies.plan import Plan
from mixfleet.twin.core import GridRates
from mixfleet.twin.world import GroupSetup, TrainerSetup


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
        prefill = np.asarray(rm.prefill_s(ctx), dtype=np.float64).tolist()  # new tokens on the same grid
        self.set_grids(max_running, ctx.tolist(), decode, ctx.tolist(), prefill)


@dataclass(frozen=True, kw_only=True)
class Overrides:
    """Measured values in place of the priors (calibration fills these; keys are the plan's group names)."""
    efficiency: dict[str, Efficiency] = field(default_factory=dict)      # per group: roofline factors
    weight_sync_s: dict[str, float] = field(default_factory=dict)        # per group: seconds per push
    mismatch: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # kl_k3, extreme share, growth
    trainer: Efficiency | None = None                                    # trainer_mfu / trainer_overhead_s


@dataclass(frozen=True, kw_only=True)
class Setup:
    groups: list[GroupSetup]
    trainer: TrainerSetup
    workload: WorkloadSpec
    models: dict[str, ReplicaModel]


def build_setup(plan: Plan, *, price_table: str | None = None, catalog: Catalog | None = None,
                overrides: Overrides | None = None) -> Setup:
    """Everything the world needs from the cost model for `plan` (with measured `overrides`, if any)."""
    ov = overrides or Overrides()
    for table in (ov.efficiency, ov.weight_sync_s, ov.mismatch):
        for name in table:
            plan.group(name)  # an unknown group name is an error that lists the plan's groups
    cat = (catalog or load_catalog(price_table or plan.price_table or None)).with_prices(plan.prices)
    model = load_model_spec(plan.model)
    workload = load_workload(plan.workload)
    trainer_acc = cat.accelerator(plan.trainer.accelerator)
    ctx = workload.mean_decode_context
    groups, models = [], {}
    for g in plan.groups:
        rm = group_replica_model(plan, g, model, cat, workload, ov.efficiency.get(g.name))
        models[g.name] = rm
        tps, usd_mtok = nominal_point(rm, ctx)
        prior = mismatch_prior(g.accelerator, g.precision, g.kv_dtype)
        kl, ext, growth = ov.mismatch.get(g.name, (prior.kl_k3, prior.extreme_share, prior.growth_per_staleness))
        groups.append(GroupSetup(
            name=g.name, rates=TabulatedRates(rm, workload.max_context, DEFAULT_MAX_BATCH * rm.dp_attention),
            replicas=g.replicas,
            min_replicas=g.min_replicas, max_replicas=g.max_replicas, capacity_tokens_per_s=tps,
            usd_per_mtoken=usd_mtok, weight_sync_s=ov.weight_sync_s.get(g.name, weight_sync_s(rm, trainer_acc)),
            kl_k3=kl, extreme_share=ext, kl_growth_per_version=growth))
    gpus = plan.trainer.gpus
    trainer = TrainerSetup(
        train_step_s=lambda tokens: float(trainer_step_s(model, trainer_acc, gpus, tokens, efficiency=ov.trainer)),
        usd_per_hour=trainer_usd_per_hour(trainer_acc.price_usd_per_gpu_hour, gpus))
    return Setup(groups=groups, trainer=trainer, workload=workload, models=models)
