"""The re-planner's solver: `solver_for(plan)`, what `policies.replan` re-solves with, in the twin and in a real run.

`planner_solver(plan, config)` re-solves a running fleet's replica counts with the planner's own analytic model
(`planner.fleet.group_types` + `metrics`: session-limited throughput, time per update = max(sampler, train + push),
staleness by Little's law, cost per update or per effective update): the plan's groups priced through the
window's fit (`calibration=`), the plan's prompts in flight and update shape, each group within its
[min_replicas, max_replicas] (only the groups the policy may touch move), under the policy's budget, staleness
and time limits. It searches from the current counts by steps of 1, 2, 4 and 8 replicas per group and
one-for-one swaps between two groups, taking the best feasible move until none improves.

`solver_for(plan)` is that solver at the plan's `replan` autoscaler settings (None for any other autoscaler): the
twin's `simulate` and the runner's orchestrator both attach it themselves (runner/ may import planner/).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from mixfleet.costmodel.calibration.record import Calibration
from mixfleet.costmodel.plan.planspec import plan_catalog, resolve_plan_sandbox, resolve_trainer
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.costmodel.specs.workload import load_workload
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import feasible, group_types, metrics
from mixfleet.planner.shape import workload_shape
from mixfleet.policies.plan import Plan
from mixfleet.policies.registry import make_config
from mixfleet.policies.replan import Proposal, Replan, Solver

SEARCH_STEPS = (1, 2, 4, 8)          # replicas per move of one group
MAX_SEARCH_ROUNDS = 200
ANCHOR_RANGE = (0.25, 4.0)           # the speed anchor's search range (factor on every fitted decode_scale)
ANCHOR_ITERATIONS = 8               # halvings of the log range: the factor to within ~1%


def planner_config(plan: Plan, config: Replan.Config, calibration: Calibration | None = None) -> PlannerConfig:
    """The planner's settings for the plan's own pool, with the policy's objective and limits (and the plan's
    sandboxes: its [sandbox] cap, start and price, as the twin runs them)."""
    sb = resolve_plan_sandbox(plan, load_workload(plan.workload))
    return PlannerConfig(model=plan.model, workload=plan.workload, price_table=plan.price_table or "modal",
                         prices=dict(plan.prices), backend=plan.cost_backend,
                         trainer_accelerator=plan.trainer.accelerator, trainer_gpus=plan.trainer.gpus,
                         objective=config.objective, max_staleness=config.max_staleness,
                         max_time_per_update_s=config.max_time_per_update_s,
                         max_usd_per_hour=config.max_usd_per_hour, verify=0, calibration=calibration,
                         **({} if sb is None else {"sandbox_cap": sb.max_live, "sandbox_start_s": sb.start_s,
                                                   "sandbox_usd_per_hour": sb.usd_per_hour}))


def planner_solver(plan: Plan, config: Replan.Config, calibration: Calibration | None = None) -> Solver:
    """A `policies.replan.Solver` for `plan`: the planner's analytic model over the plan's groups (see the module
    doc), each call on the window's fit with its speeds anchored (one factor on every group's decode_scale) so
    that the model's time per update at the current counts is the measured one. `calibration`: what the plan was
    sized on (None: the priors); `solve(None, ...)` prices the counts on it (the oracle's and the static plan's
    sizing in benchmarks/replan_bench.py)."""
    base = planner_config(plan, config, None)
    wl = load_workload(plan.workload)
    bat = plan.build_policies(wl)["batcher"].config
    shape = (bat.prompts_per_update, bat.samples_per_prompt)
    k = bat.inflight_prompts
    names = [g.name for g in plan.groups]
    lo = np.array([g.min_replicas for g in plan.groups])
    hi = np.array([g.max_replicas for g in plan.groups])

    def scaled(fit: Calibration, a: float) -> Calibration:
        """The fit with every group's decode_scale (and prefill overhead) times `a`."""
        gs = tuple(replace(g, decode_scale=replace(g.decode_scale, value=g.decode_scale.value * a),
                           prefill_overhead_s=replace(g.prefill_overhead_s, value=g.prefill_overhead_s.value * a))
                   for g in fit.groups)
        return replace(fit, groups=gs)

    def trainer_anchored(fit: Calibration, measured_s: float) -> tuple[Calibration, float]:
        """The fit with its trainer step (scale and overhead) times the factor that makes the model's step at the
        plan's batch the window's measured mean step (unchanged when not measured). The model prices a batch at
        the plan's workload's tokens, the real run's batches are what they are: on replan-cpu the prior workload's
        tokens put the model's step at 79 s against 44 s measured, which made the model trainer-bound (staleness
        unbounded) on a run that was not."""
        if not (math.isfinite(measured_s) and measured_s > 0):
            return fit, 1.0
        cfg, _ = model(fit)
        tr = resolve_trainer(cfg.trainer_accelerator, cfg.trainer_gpus, model=load_model_spec(cfg.model),
                             catalog=plan_catalog(plan), calibration=fit)
        if tr.calibration is None:       # a fit made on another trainer accelerator: the prior step, not anchored
            return fit, 1.0
        step = float(tr.step_s(shape[0] * shape[1] * workload_shape(wl, shape[1]).generated_per_episode))
        own = step - fit.update_overhead_s.value
        if not (own > 0 and math.isfinite(own)):
            return fit, 1.0
        r = measured_s / own
        return replace(fit, trainer_scale=replace(fit.trainer_scale, value=fit.trainer_scale.value * r),
                       trainer_overhead_s=replace(fit.trainer_overhead_s, value=fit.trainer_overhead_s.value * r)), r

    def model(cal: Calibration | None) -> tuple[PlannerConfig, list]:
        cfg = replace(base, calibration=cal)
        return cfg, group_types(cfg, only=list(plan.groups))

    def anchor(fit: Calibration, x0: np.ndarray, measured_s: float) -> float:
        """The factor on every fitted decode_scale at which the model's time per update at the current counts is
        the measured one (1 when the trainer bounds it, or it is not measured): bisection on a log scale."""
        if not (math.isfinite(measured_s) and measured_s > 0):
            return 1.0
        lo, hi = math.log(ANCHOR_RANGE[0]), math.log(ANCHOR_RANGE[1])

        def t_update(a: float) -> tuple[float, bool]:
            cfg, types = model(scaled(fit, a))
            m = metrics(types, x0[None, :], np.array([k]), cfg, shape)
            return float(m["time_per_update_s"][0]), bool(m["trainer_bound"][0])

        t_hi, bound_hi = t_update(math.exp(hi))
        if bound_hi or t_hi < measured_s:
            return math.exp(hi) if not bound_hi else 1.0
        for _ in range(ANCHOR_ITERATIONS):
            mid = 0.5 * (lo + hi)
            t, bound = t_update(math.exp(mid))
            if bound or t < measured_s:
                lo = mid
            else:
                hi = mid
        return math.exp(0.5 * (lo + hi))

    def solve(fit: Calibration | None, current: dict[str, int], touch: tuple[str, ...],
              measured: dict[str, float]) -> Proposal:
        x0 = np.array([int(current.get(n, g.replicas)) for n, g in zip(names, plan.groups, strict=True)])
        ta = 1.0
        if fit is None:   # no measurements: the values the plan was sized on, as they are
            a = 1.0
            cfg, types = model(calibration)
        else:
            fit, ta = trainer_anchored(fit, float(measured.get("train_step_s", math.nan)))
            a = anchor(fit, x0, float(measured.get("time_per_update_s", math.nan)))
            cfg, types = model(scaled(fit, a))
        free = np.array([n in touch for n in names])
        lo_t, hi_t = np.where(free, lo, x0), np.where(free, hi, x0)

        def score(rows: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
            m = metrics(types, rows, np.full(len(rows), k), cfg, shape)
            ok = feasible(m, cfg) & (rows.sum(1) > 0)
            return np.where(ok, m[cfg.objective], np.inf), m

        x = x0.copy()
        best, _ = score(x[None, :])
        eye = np.eye(len(x), dtype=int)
        moves = [d * e for d in SEARCH_STEPS for e in eye] + [-d * e for d in SEARCH_STEPS for e in eye]
        moves += [eye[i] - eye[j] for i in range(len(x)) for j in range(len(x)) if i != j]
        moves_a = np.array(moves, dtype=int)
        for _ in range(MAX_SEARCH_ROUNDS):
            rows = x[None, :] + moves_a
            rows = rows[((rows >= lo_t) & (rows <= hi_t)).all(1)]
            if not len(rows):
                break
            sc, _ = score(rows)
            i = int(np.argmin(sc))
            if not sc[i] < best[0] * (1 - 1e-9):
                break
            x, best = rows[i], sc[i:i + 1]
        obj, m = score(np.stack([x0, x]))
        raw = m[cfg.objective]
        note = "" if math.isfinite(obj[1]) else "no counts within the pool meet the limits"
        return Proposal(counts={n: int(c) for n, c in zip(names, x, strict=True)}, objective_now=float(raw[0]),
                        objective_new=float(raw[1]), time_per_update_now_s=float(m["time_per_update_s"][0]),
                        time_per_update_new_s=float(m["time_per_update_s"][1]), staleness_now=float(m["staleness"][0]),
                        staleness_new=float(m["staleness"][1]), feasible=bool(math.isfinite(obj[1])), anchor=a,
                        trainer_anchor=ta, note=note)

    return solve


def solver_for(plan: Plan, calibration: Calibration | None = None) -> Solver | None:
    """The solver a plan's `replan` autoscaler re-solves with (`planner_solver` at its settings), None for any
    other autoscaler: what the twin's `simulate` and the runner's orchestrator attach to it."""
    ref = plan.policies.autoscaler
    if ref.name != "replan":
        return None
    return planner_solver(plan, make_config("autoscaler", ref.name, ref.settings), calibration)
