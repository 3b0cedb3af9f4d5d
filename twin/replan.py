"""The twin's side of the re-planning loop: "truth" calibrations for the re-planning bench.

`perturbed_truth(plan, slower=..., mismatch=...)` builds the calibration a dry run's world runs on while the
planner and the re-planner start from the priors (`simulate(plan, truth=...)`): every group at its prior, some
slower (speed x factor) or more mismatched (KL and extreme share x factor). The re-planner's solver itself is the
planner's (`planner.solver.solver_for`), which `simulate` attaches.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from mixfleet.costmodel.calibration.record import Calibration, Fitted, GroupCalibration
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.plan.planspec import plan_catalog, resolve_groups
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.policies.plan import Plan


def perturbed_truth(plan: Plan, *, slower: Mapping[str, float] | None = None,
                    mismatch: Mapping[str, float] | None = None) -> Calibration:
    """A calibration holding every group of `plan` at its prior except: `slower[g]` = f, the group's speed x f
    (decode_scale 1 / f: 0.6 is 40% slower); `mismatch[g]` = m, its KL and extreme-ratio share x m. The trainer at
    its prior; no measured workload (the plan's stays)."""
    slower, mismatch = dict(slower or {}), dict(mismatch or {})
    names = [g.name for g in plan.groups]
    for what, d in (("slower", slower), ("mismatch", mismatch)):
        for g, f in d.items():
            if g not in names:
                raise SpecError("perturbed_truth", f"{what}.{g}", f, "a group of the plan: " + ", ".join(names))
            if not (isinstance(f, int | float) and f > 0):
                raise SpecError("perturbed_truth", f"{what}.{g}", f, "a factor > 0")
    cat = plan_catalog(plan)
    groups = []
    for r in resolve_groups(plan, catalog=cat):
        g = r.group
        f, m = float(slower.get(g.name, 1.0)), float(mismatch.get(g.name, 1.0))
        fx = lambda v, prior, unit="": Fitted(value=v, stderr=0.0, prior=prior, unit=unit, note="truth")  # noqa: E731
        groups.append(GroupCalibration(
            name=g.name, accelerator=g.accelerator, precision=g.precision, kv_dtype=g.kv_dtype, kernel=g.kernel,
            decode_scale=fx(1.0 / f, 1.0, "x"),
            prefill_overhead_s=fx(r.prior.prefill_overhead_s / f, r.prior.prefill_overhead_s, "s"),
            weight_sync_s=fx(r.weight_sync_s, r.weight_sync_s, "s"),
            kl_k3=fx(r.kl_k3 * m, r.kl_k3, "nats/token"),
            kl_growth_per_staleness=fx(r.kl_growth_per_staleness, r.kl_growth_per_staleness, "1/version"),
            extreme_share=fx(min(1.0, r.extreme_share * m), r.extreme_share, "share"),
            extreme_growth_per_staleness=fx(r.kl_growth_per_staleness, r.kl_growth_per_staleness, "1/version")))
    acc = cat.accelerator(plan.trainer.accelerator)
    return Calibration(groups=tuple(groups), trainer_accelerator=acc.name, trainer_gpus=plan.trainer.gpus,
                       trainer_scale=Fitted(value=1.0, stderr=0.0, prior=1.0, unit="x"),
                       trainer_overhead_s=Fitted(value=acc.trainer_overhead_s, stderr=0.0,
                                                 prior=acc.trainer_overhead_s, unit="s"),
                       update_overhead_s=Fitted(value=0.0, stderr=0.0, prior=0.0, unit="s"),
                       turn_latency_s=Fitted(value=0.0, stderr=0.0, prior=0.0, unit="s"),
                       model=load_model_spec(plan.model).name,
                       runs=(f"truth: slower {slower or '{}'}, mismatch {mismatch or '{}'}",),
                       created_utc=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
