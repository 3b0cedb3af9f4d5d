"""The planner's search: candidate mixes from integer programs, screened by the analytic model (planner/fleet.py),
the best few verified by a twin check the caller hands in, the Pareto set, and what binds.

2. Candidates come from integer programs (`scipy.optimize.milp`: cheapest fleet reaching each of a sweep of
   throughput targets under the GPU caps and budget), their +-1 neighbours and single-type fleets, each with
   several K (prompts in flight), screened by `fleet.metrics`.
3. Verify the best few (default 3) in the twin's steady state (`simulate` from a warm start, then costmodel's
   steady-state analysis: the pipeline fill and the MSER-5 warm-up left out, 95% batch-means intervals), on
   `verify_seeds` seeds each, and re-rank them by it (those meeting the constraints in the twin first, then the
   objective); the chosen plan's figures are the twin's, the analytic ones beside them. Report the Pareto set
   (cost/update, time/update, staleness). The checks are independent jobs handed to a map
   (`plan_mix(check=..., check_map=...)`), with the same results for the same seeds whatever runs them;
   `PlanResult.checks` says how many workers and nodes ran them and the wall time.

The planner imports no twin: the check itself (`check`, the twin's `twin.checks.twin_check`: one job = a plan
dict, updates, seed, calibration -> its steady-state figures) and the map that runs the jobs (`check_map`:
`sequential_map` here, one after another in this process, the reference; the twin's `twin.checks.default_map`,
this machine's cores with each result kept on disk under its inputs' digest; or
`mixfleet.runner.orchestration.ray_map.ray_map`, Ray tasks) are handed in by the caller (`mixfleet plan`, the
app's Plan page, tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.plan.planspec import FaultsPlan, SandboxPlan, resolve_plan_sandbox
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.costmodel.specs.workload import load_workload
from mixfleet.planner.config import DEFAULT_SANDBOX_START_S, PlannerConfig, pool_catalog
from mixfleet.planner.fleet import GroupType, feasible, group_types, metrics
from mixfleet.planner.spot import expected_lost_work
from mixfleet.policies.plan import Plan, PoliciesPlan, PolicyRef, TrainerPlan
from scipy.optimize import Bounds, LinearConstraint, milp

K_FACTORS = (1, 2, 3, 4, 6, 8)     # prompts in flight, in units of prompts per update
Check = Callable[..., dict[str, Any]]   # one twin check: (plan dict, updates, seed, calibration) -> its figures
CheckMap = Callable[[Check, list[tuple[Any, ...]]], tuple[list[dict[str, Any]], dict[str, Any]]]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    replicas: dict[str, int]
    inflight_prompts: int
    throughput_tokens_per_s: float
    time_per_update_s: float
    staleness: float
    usd_per_hour: float
    cost_per_update_usd: float
    cost_per_effective_update_usd: float
    kept_share: float                # 1 - masked share of the mix's tokens
    trainer_bound: bool
    verified: dict[str, Any] = field(default_factory=dict)  # the twin's steady state (`verify_candidates`)
    # cost per update split (sampling fleet, trainer, sandboxes); sandboxes: the pool-wait share and the mean live
    cost_sampling_per_update_usd: float = math.nan
    cost_training_per_update_usd: float = math.nan
    cost_sandbox_per_update_usd: float = 0.0
    sandbox_wait_share: float = 0.0      # 0 without sandboxes (not NaN: verified figures compare equal, bit for bit)
    sandboxes_live: float = 0.0
    lost_work: dict[str, Any] = field(default_factory=dict)  # expected preemption losses (`expected_lost_work`)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


@dataclass(frozen=True, kw_only=True)
class Binding:
    """One constraint that keeps a feasible plan from a better objective: relaxed alone, the screen's best
    objective would be `relaxed_objective` (vs `objective`), at `relaxed_value` of the limited metric. A GPU cap
    the chosen mix uses up is reported with `relaxed_objective` None: the screen cannot say what more GPUs buy
    without building the candidates again."""
    flag: str                          # the CLI flag (e.g. '--max-staleness'); '--max-gpus' for a cap
    what: str                          # the limited metric in words, or the accelerator for a cap
    limit: float
    unit: str
    objective: float                   # the chosen screen objective (cost per (effective) update)
    relaxed_objective: float | None
    relaxed_value: float | None
    per: str = "update"                # the objective's unit: 'update' or 'effective update'

    @property
    def gain(self) -> float | None:
        """The objective's relative saving if this constraint alone were relaxed (0.12 = 12% cheaper)."""
        if self.relaxed_objective is None or not self.objective > 0:
            return None
        return 1.0 - self.relaxed_objective / self.objective

    def text(self, names: Mapping[str, str] | None = None) -> str:
        """One sentence; `names` maps a CLI flag to the name a page gives the same setting (the app's labels)."""
        flag = (names or {}).get(self.flag)
        if self.relaxed_objective is None:
            head = f"{flag} for {self.what}" if flag else f"{self.flag} {self.what}"
            return (f"{head}={self.limit:g}: the chosen mix uses all {self.limit:g} GPUs allowed; "
                    "more may buy a cheaper mix")
        value = (f"{self.what} {self.relaxed_value:,.3g} {self.unit}" if math.isfinite(self.relaxed_value or 0.0)
                 else f"{self.what} unbounded (a trainer-bound mix)")
        if self.flag == "--sandbox-cap":   # a count of sandboxes, in full
            value = f"{self.relaxed_value:,.0f} {self.what}"
        return (f"{flag or self.flag} {self.limit:g} binds: without it the cheapest mix screened costs "
                f"${self.relaxed_objective:,.2f} per {self.per} ({self.gain:.0%} less than ${self.objective:,.2f}) at "
                + value)


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    best: Candidate | None
    plan: Plan | None
    pareto: list[Candidate]
    screened: int
    feasible: int
    types: list[GroupType]
    note: str = ""
    verified: list[Candidate] = field(default_factory=list)  # the twin-verified candidates, in the twin's order
    on_demand: Candidate | None = None   # with cfg.spot: the best mix without spot groups (verified alike)
    checks: dict[str, Any] = field(default_factory=dict)  # the twin checks: mode, tasks, workers, nodes, wall_s
    binds: list[Binding] = field(default_factory=list)  # what keeps the chosen mix from a cheaper one (`what_binds`)



@contextlib.contextmanager
def _quiet_native_stdout() -> Iterator[None]:
    """HiGHS (scipy's milp) prints debugging lines ("HighsMipSolverData::...") from C++ straight to file
    descriptor 1 even with disp off; send fd 1 to /dev/null meanwhile (Python's own output is flushed first)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # no real stdout (captured): nothing to keep clean
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def _milp_candidates(types: list[GroupType], cfg: PlannerConfig, trainer_usd_h: float, effective: bool) -> np.ndarray:
    """Cheapest fleets reaching a sweep of throughput targets (integer replicas, GPU caps, budget)."""
    price = np.array([t.usd_per_hour for t in types])
    tps = np.array([t.tokens_per_s * (1 - t.loss_share) * ((1 - t.masked_share) if effective else 1.0)
                    for t in types])
    accs = sorted({t.accelerator for t in types})
    cap_rows = np.array([[t.tp if t.accelerator == a else 0 for t in types] for a in accs], dtype=float)
    caps = np.array([cfg.max_gpus.get(a, cfg.default_max_gpus) for a in accs], dtype=float)
    ub = np.array([math.floor(cfg.max_gpus.get(t.accelerator, cfg.default_max_gpus) / t.tp) for t in types])
    cons = [LinearConstraint(cap_rows, -np.inf, caps)]
    if cfg.max_usd_per_hour is not None:
        cons.append(LinearConstraint(price[None, :], -np.inf, cfg.max_usd_per_hour - trainer_usd_h))
    t_max = float(tps @ ub)
    out = []
    for target in np.geomspace(max(tps.min(), 1.0), t_max, 32):
        with _quiet_native_stdout():
            res = milp(c=price, integrality=np.ones(len(types)), bounds=Bounds(0, ub),
                       constraints=[*cons, LinearConstraint(tps[None, :], target, np.inf)],
                       options={"time_limit": 2.0})
        if res.x is not None:
            out.append(np.round(res.x).astype(int))
    return np.unique(np.array(out, dtype=int).reshape(-1, len(types)), axis=0)


def screen(types: list[GroupType], cfg: PlannerConfig) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """All candidates (mixes x K) and their analytic metrics, vectorized."""
    cat = pool_catalog(cfg)
    wl = load_workload(cfg.workload)
    trainer_usd_h = cfg.trainer_gpus * cat.accelerator(cfg.trainer_accelerator).price_usd_per_gpu_hour
    mixes = [_milp_candidates(types, cfg, trainer_usd_h, eff) for eff in (False, True)]
    base = np.unique(np.vstack(mixes), axis=0) if any(len(m) for m in mixes) else np.zeros((0, len(types)), int)
    eye = np.eye(len(types), dtype=int)
    neigh = np.vstack([base, *(base + d for d in eye), *(base - d for d in eye)]) if len(base) else base
    ub = np.array([math.floor(cfg.max_gpus.get(t.accelerator, cfg.default_max_gpus) / t.tp) for t in types])
    singles = np.vstack([eye * n for n in (1, 2, 4, 8, 16, 32, 64)])
    mix = np.unique(np.vstack([neigh, singles]), axis=0)
    mix = mix[(mix >= 0).all(1) & (mix <= ub).all(1) & (mix.sum(1) > 0)]
    accs = sorted({t.accelerator for t in types})
    gpus_by_acc = np.stack([(mix * np.array([t.tp if t.accelerator == a else 0 for t in types])).sum(1) for a in accs])
    caps = np.array([cfg.max_gpus.get(a, cfg.default_max_gpus) for a in accs])[:, None]
    mix = mix[(gpus_by_acc <= caps).all(0)]
    kf = np.array(K_FACTORS)
    n = np.repeat(mix, len(kf), axis=0)
    k = np.tile(kf * wl.prompts_per_update, len(mix))
    return n, k, metrics(types, n, k, cfg)



def evaluate_plan(plan: Plan, cfg: PlannerConfig | None = None) -> Candidate:
    """The analytic model's numbers for an existing plan (e.g. a seed fleet), for comparison with the DES."""
    wl = load_workload(plan.workload)
    sb = resolve_plan_sandbox(plan, wl)   # the plan's sandboxes, as the twin runs them
    cfg = cfg or PlannerConfig(model=plan.model, workload=plan.workload, price_table=plan.price_table or "modal",
                               prices=dict(plan.prices), backend=plan.cost_backend,
                               trainer_accelerator=plan.trainer.accelerator, trainer_gpus=plan.trainer.gpus,
                               **({} if sb is None else {"sandbox_cap": sb.max_live, "sandbox_start_s": sb.start_s,
                                                         "sandbox_usd_per_hour": sb.usd_per_hour}))
    types = group_types(cfg, only=list(plan.groups))
    n = np.array([g.replicas for g in plan.groups])
    b = plan.build_policies(wl)["batcher"].config
    shape = (b.prompts_per_update, b.samples_per_prompt)
    return _candidate(types, n, b.inflight_prompts,
                      metrics(types, n[None, :], np.array([b.inflight_prompts]), cfg, shape), 0)



_LIMITS = (("max_staleness", "staleness", "--max-staleness", "mean staleness", "versions"),
           ("max_time_per_update_s", "time_per_update_s", "--max-time-per-update", "time per update", "s"),
           ("max_usd_per_hour", "usd_per_hour", "--budget", "USD per hour", "USD/h"))


def binding_constraints(m: dict[str, np.ndarray], cfg: PlannerConfig) -> str:
    """Why no candidate is feasible: each limit with the best value any candidate reaches (it binds when that
    is over the limit) and, for a limit met alone, the best within the other limits; the GPU caps the
    candidates were built under."""
    def fmt(v: float, unit: str) -> str:
        return f"{v:,.3g} {unit}" if math.isfinite(v) else "none"

    parts = []
    for field_name, metric, flag, what, unit in _LIMITS:
        limit = getattr(cfg, field_name)
        if limit is None:
            continue
        best = float(m[metric].min())
        if best > limit + 1e-9:
            parts.append(f"{flag} {limit:g} binds: the best {what} of any candidate is {fmt(best, unit)}")
            continue
        within = m[metric][feasible(m, replace(cfg, **{field_name: None}))]
        parts.append(f"{flag} {limit:g} holds alone (best {fmt(best, unit)}) but not with the others: the best "
                     f"{what} within them is {fmt(float(within.min()) if len(within) else math.inf, unit)}")
    caps = ", ".join(f"{a}={c}" for a, c in cfg.max_gpus.items())
    return (f"no candidate meets the constraints ({len(m['cost_per_update']):,} screened): " + "; ".join(parts)
            + f". GPU caps: {caps + ', ' if caps else ''}{cfg.default_max_gpus} per other accelerator "
            "(--max-gpus, --default-max-gpus); relax a limit that binds.")


def what_binds(m: dict[str, np.ndarray], cfg: PlannerConfig, chosen: int, gpus: dict[str, int] | None = None,
               *, min_gain: float = 1e-3, uncapped: dict[str, np.ndarray] | None = None) -> list[Binding]:
    """The constraints that bind on a feasible plan, in order of what relaxing each alone would save: a limit
    binds when the screen's best objective without it (the other limits kept) is lower than the chosen one's by
    more than `min_gain`; a GPU cap binds (may bind) when the chosen mix uses all of it (`gpus`: per accelerator).
    `chosen`: the screen row of the best feasible candidate. None binding: the mix is the cheapest screened.
    `uncapped`: the same rows' metrics without the sandbox cap (`cfg.sandbox_cap`): the cap binds when the best
    of them within the limits is cheaper; its value is then the sandboxes that mix keeps live on average."""
    best = float(m[cfg.objective][chosen])
    per = "effective update" if cfg.objective == "cost_per_effective_update" else "update"
    out: list[Binding] = []
    for field_name, metric, flag, what, unit in _LIMITS:
        limit = getattr(cfg, field_name)
        if limit is None:
            continue
        idx = np.flatnonzero(feasible(m, replace(cfg, **{field_name: None})))
        if not len(idx):
            continue
        i = int(idx[np.argmin(m[cfg.objective][idx])])
        relaxed = float(m[cfg.objective][i])
        if relaxed < best * (1.0 - min_gain):
            out.append(Binding(flag=flag, what=what, limit=float(limit), unit=unit, objective=best,
                               relaxed_objective=relaxed, relaxed_value=float(m[metric][i]), per=per))
    if uncapped is not None and cfg.sandbox_cap is not None:
        idx = np.flatnonzero(feasible(uncapped, cfg))
        if len(idx):
            i = int(idx[np.argmin(uncapped[cfg.objective][idx])])
            relaxed = float(uncapped[cfg.objective][i])
            if relaxed < best * (1.0 - min_gain):
                out.append(Binding(flag="--sandbox-cap", what="sandboxes live on average", limit=float(cfg.sandbox_cap),
                                   unit="", objective=best, relaxed_objective=relaxed,
                                   relaxed_value=float(uncapped["sandboxes_live"][i]), per=per))
    out.sort(key=lambda b: -(b.gain or 0.0))
    for acc, used in sorted((gpus or {}).items()):
        cap = cfg.max_gpus.get(acc, cfg.default_max_gpus)
        if used >= cap:
            out.append(Binding(flag="--max-gpus", what=acc, limit=float(cap), unit="GPUs", objective=best,
                               relaxed_objective=None, relaxed_value=None, per=per))
    return out


def binds_text(binds: list[Binding], names: Mapping[str, str] | None = None) -> str:
    """What binds, in one sentence; 'no limit binds' when the chosen mix is the cheapest screened. `names`: the
    settings' names where they are not CLI flags (the app's field labels, by flag)."""
    if not binds:
        return "no limit binds: the chosen mix is the cheapest screened"
    return "; ".join(b.text(names) for b in binds)


def pareto_mask(points: np.ndarray) -> np.ndarray:
    """Rows not dominated by another (all objectives minimized; inf allowed)."""
    # A point's dominator is lexicographically smaller, and dominance is transitive, so walking the points in
    # lexicographic order each needs checking only against the non-dominated points met so far.
    keep = np.zeros(len(points), dtype=bool)
    front = np.empty((0, points.shape[1]) if points.ndim == 2 else (0, 0))
    for i in np.lexsort(points.T[::-1]) if len(points) else ():
        p = points[i]
        if not ((front <= p).all(1) & (front < p).any(1)).any():
            keep[i] = True
            front = np.vstack([front, p])
    return keep


def _candidate(types: list[GroupType], n: np.ndarray, k: int, m: dict[str, np.ndarray], i: int) -> Candidate:
    return Candidate(replicas={t.name: int(c) for t, c in zip(types, n, strict=True) if c > 0},
                     inflight_prompts=int(k), throughput_tokens_per_s=float(m["throughput"][i]),
                     time_per_update_s=float(m["time_per_update_s"][i]), staleness=float(m["staleness"][i]),
                     usd_per_hour=float(m["usd_per_hour"][i]), cost_per_update_usd=float(m["cost_per_update"][i]),
                     cost_per_effective_update_usd=float(m["cost_per_effective_update"][i]),
                     kept_share=float(m["kept_share"][i]), trainer_bound=bool(m["trainer_bound"][i]),
                     cost_sampling_per_update_usd=float(m["cost_sampling_per_update"][i]),
                     cost_training_per_update_usd=float(m["cost_training_per_update"][i]),
                     cost_sandbox_per_update_usd=float(m["cost_sandbox_per_update"][i]),
                     sandbox_wait_share=float(m["sandbox_wait_share"][i]),
                     sandboxes_live=float(m["sandboxes_live"][i]))


def candidate_plan(c: Candidate, types: list[GroupType], cfg: PlannerConfig, name: str = "planned") -> Plan:
    """The Plan for a candidate (capacity-proportional routing, fixed replicas, in-flight weight sync)."""
    by_name = {t.name: t for t in types}
    # each type's group as planned (the layout search's GPUs recorded; the smallest-TP ones keep tp = 0)
    groups = tuple(replace(by_name[g].group, name=g, replicas=r, min_replicas=r, max_replicas=r)
                   for g, r in c.replicas.items())
    wl = load_workload(cfg.workload)
    cat = load_catalog(cfg.price_table)
    used = {cat.accelerator(a).name for a in [cfg.trainer_accelerator, *(g.accelerator for g in groups)]}
    return Plan(sandbox=candidate_sandbox(c, cfg, wl.samples_per_prompt),
                name=name, groups=groups, seed=cfg.seed, model=cfg.model, workload=cfg.workload,
                cost_backend=cfg.backend,
                price_table=cfg.price_table, description=f"mixfleet plan ({cfg.objective})",
                prices={a: usd for a, usd in cfg.prices.items() if a in used},
                trainer=TrainerPlan(accelerator=cfg.trainer_accelerator, gpus=cfg.trainer_gpus),
                faults=FaultsPlan(on_loss=cfg.on_loss, spot_preemptions_per_replica_hour=cfg.spot_preemptions_per_hour),
                policies=PoliciesPlan(batcher=PolicyRef(name="fifo", settings={
                    "prompts_per_update": wl.prompts_per_update, "samples_per_prompt": wl.samples_per_prompt,
                    "inflight_prompts": c.inflight_prompts})))


def candidate_sandbox(c: Candidate, cfg: PlannerConfig, samples_per_prompt: int) -> SandboxPlan | None:
    """The plan's [sandbox] for a candidate: the user's cap, or (sized with the fleet) one per episode of the
    prompts in flight, so no episode waits; None without sandboxes."""
    if not cfg.sandboxes:
        return None
    cap = cfg.sandbox_cap if cfg.sandbox_cap is not None else c.inflight_prompts * samples_per_prompt
    how = ("the cap: the user's (--sandbox-cap)" if cfg.sandbox_cap is not None else
           "the cap sized with the fleet (every episode in flight; "
           f"Little's law puts {c.sandboxes_live:,.0f} live on average)")
    return SandboxPlan(max_live=int(cap), start_s=float(cfg.sandbox_start_s),
                       price_per_hour_usd=cfg.sandbox_usd_per_hour,
                       source=f"mixfleet plan: {how}; start latency {cfg.sandbox_start_s:g} s"
                              + (" (default, an estimate est-2026-12)" if cfg.sandbox_start_s ==
                                 DEFAULT_SANDBOX_START_S else " (given)"))


def sequential_map(fn: Callable[..., dict[str, Any]], jobs: list[tuple[Any, ...]]
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The twin checks one after another in this process (the reference path; `CheckMap`'s contract: the results
    in the jobs' order, and what ran them)."""
    return [fn(*job) for job in jobs], {"mode": "sequential", "workers": 1, "nodes": 1}


def plan_mix(cfg: PlannerConfig, progress: Callable[[str], None] | None = None, *, check: Check | None = None,
             check_map: CheckMap | None = None) -> PlanResult:
    """Screen, pick the best feasible candidate by the objective, verify the top few in the DES.
    check: one twin check (the twin's `twin.checks.twin_check`), needed when `cfg.verify` > 0. check_map: runs the
    check jobs and says what ran them; default `sequential_map` (one after another in this process); the twin's
    `twin.checks.default_map` runs them on this machine's cores with each result cached on disk by its inputs'
    digest, `mixfleet.runner.orchestration.ray_map.ray_map` as Ray tasks, all with the same results."""
    if cfg.verify and check is None:
        raise SpecError("plan", "verify", cfg.verify, "0, or a twin check to verify with (plan_mix(check=...): "
                        "twin.checks.twin_check)")
    say = progress or (lambda _m: None)
    say("group types")
    types = group_types(cfg)
    if not types:
        return PlanResult(best=None, plan=None, pareto=[], screened=0, feasible=0, types=[],
                          note="no (accelerator, precision) in the pool fits the model")
    say(f"screening ({len(types)} group types)")
    n, k, m = screen(types, cfg)
    ok = feasible(m, cfg)
    idx = np.flatnonzero(ok)
    if not len(idx):
        return PlanResult(best=None, plan=None, pareto=[], screened=len(n), feasible=0, types=types,
                          note=binding_constraints(m, cfg))
    obj = m[cfg.objective][idx]
    order = idx[np.lexsort((m["time_per_update_s"][idx], obj))]
    pts = np.stack([m["cost_per_update"][idx], m["time_per_update_s"][idx], m["staleness"][idx]], axis=1)
    par = idx[pareto_mask(pts)]
    par = par[np.argsort(m["cost_per_update"][par])]
    pareto = [_candidate(types, n[i], k[i], m, i) for i in par]
    top = [_candidate(types, n[i], k[i], m, i) for i in order[:max(cfg.verify, 1)]]
    on_demand = None
    if cfg.spot:   # the best mix without spot groups, for "with and without spot"
        spot_cols = np.array([t.spot for t in types])
        od = order[~(n[order][:, spot_cols] > 0).any(1)] if spot_cols.any() else order
        on_demand = _candidate(types, n[od[0]], k[od[0]], m, od[0]) if len(od) else None
    verified: list[Candidate] = []
    checks: dict[str, Any] = {}
    if cfg.verify:
        to_check = top[:cfg.verify]
        if on_demand is not None and on_demand not in to_check:
            to_check = [*to_check, on_demand]
        say(f"verifying {len(to_check)} candidates x {cfg.verify_seeds} seeds in the twin's steady state")
        done, checks = verify_candidates(to_check, types, cfg, check=check, check_map=check_map)
        if on_demand is not None:
            on_demand = done[to_check.index(on_demand)]
        verified = done[:len(top[:cfg.verify])]
        verified.sort(key=lambda c: _twin_rank(c, cfg))  # the twin's steady state decides among them
        top = verified + top[cfg.verify:]
    best = top[0]
    if cfg.spot:
        best = replace(best, lost_work=expected_lost_work(best, types, cfg))
        if on_demand is not None:
            on_demand = replace(on_demand, lost_work=expected_lost_work(on_demand, types, cfg))
    by_name, gpus = {t.name: t for t in types}, {}
    for g, c in best.replicas.items():   # the chosen mix's GPUs per accelerator (its caps may bind)
        gpus[by_name[g].accelerator] = gpus.get(by_name[g].accelerator, 0) + c * by_name[g].tp
    uncapped = None
    if cfg.sandboxes and cfg.sandbox_cap is not None:   # what relaxing the sandbox cap buys
        say("screening without the sandbox cap")
        uncapped = metrics(types, n, k, replace(cfg, sandbox_cap=None))
    return PlanResult(best=best, plan=candidate_plan(best, types, cfg), pareto=pareto, screened=len(n),
                      feasible=int(ok.sum()), types=types, verified=verified, on_demand=on_demand, checks=checks,
                      binds=what_binds(m, cfg, int(order[0]), gpus, uncapped=uncapped))


def verify_updates(c: Candidate, cfg: PlannerConfig, prompts_per_update: int) -> int:
    """Updates of a verification run: `cfg.verify_updates`, or (0) 10 + K / B: a warm start (`simulate`'s
    `warm_start`) still settles over about one prompt-group lifetime (K / B updates), then ~10 steady updates."""
    if cfg.verify_updates:
        return cfg.verify_updates
    return int(10 + math.ceil(c.inflight_prompts / prompts_per_update))



_MEANS = ("time_per_update_s", "cost_per_update_usd", "cost_sampler_per_update_usd", "staleness", "tokens_per_s",
          "fill_s", "turns_lost", "sessions_restarted", "cost_sandbox_per_update_usd", "sandbox_wait_share")
_HALF_WIDTHS = {"time_per_update_ci_s": "time_per_update_s", "cost_per_update_ci_usd": "cost_per_update_usd",
                "cost_sampler_per_update_ci_usd": "cost_sampler_per_update_usd", "staleness_ci": "staleness",
                "cost_sandbox_per_update_ci_usd": "cost_sandbox_per_update_usd"}


def _verified(c: Candidate, runs: list[dict[str, Any]], cfg: PlannerConfig) -> Candidate:
    """The candidate with `verified` filled from its twin checks (one per seed): each figure the mean over the
    seeds, each 95% half-width sqrt(sum of the seeds' squared half-widths) / seeds (independent runs); one seed
    gives that run's figures as they are. `seeds` keeps every run."""
    if len(runs) == 1:
        v = {k: runs[0][k] for k in (*_MEANS, *_HALF_WIDTHS)}
        ext = runs[0]["extreme_share"]
    else:
        v = {k: float(np.mean([r[k] for r in runs])) for k in _MEANS}
        v.update({k: float(math.sqrt(sum(r[k] ** 2 for r in runs)) / len(runs)) for k in _HALF_WIDTHS})
        ext = float(np.mean([r["extreme_share"] for r in runs]))
    kept = 1.0 - ext if math.isfinite(ext) else c.kept_share
    v.update(cost_per_effective_update_usd=v["cost_per_update_usd"] / kept, updates=runs[0]["updates"],
             warmup_updates=max(r["warmup_updates"] for r in runs),
             steady_updates=min(r["steady_updates"] for r in runs))
    v["feasible"] = bool(feasible({"cost_per_update": np.array([v["cost_per_update_usd"]]),
                                    "staleness": np.array([v["staleness"]]),
                                    "time_per_update_s": np.array([v["time_per_update_s"]]),
                                    "usd_per_hour": np.array([c.usd_per_hour])}, cfg)[0])
    if len(runs) > 1:
        v["seeds"] = [{k: r[k] for k in ("seed", "time_per_update_s", "cost_per_update_usd", "staleness")}
                      for r in runs]
    return Candidate(**{**{f: getattr(c, f) for f in c.__dataclass_fields__}, "verified": v})


def verify_candidates(cands: list[Candidate], types: list[GroupType], cfg: PlannerConfig, *, check: Check,
                      check_map: CheckMap | None = None) -> tuple[list[Candidate], dict[str, Any]]:
    """Every candidate verified on `cfg.verify_seeds` seeds (cfg.seed, cfg.seed + 1, ...): one `check` job per
    (candidate, seed): (the candidate's plan as `Plan.to_dict`, `verify_updates`, the seed, `cfg.calibration`), all
    handed to `check_map` at once (default `sequential_map`; see `plan_mix`), then combined per candidate
    (`_verified`). Returns the candidates in their order and what ran the checks (mode, tasks, workers, nodes,
    wall_s)."""
    ppu = load_workload(cfg.workload).prompts_per_update
    seeds = [cfg.seed + i for i in range(cfg.verify_seeds)]
    jobs = [(candidate_plan(c, types, cfg).to_dict(), verify_updates(c, cfg, ppu), seed, cfg.calibration)
            for c in cands for seed in seeds]
    wall0 = time.perf_counter()
    runs, info = (check_map or sequential_map)(check, jobs)
    info = {**info, "tasks": len(jobs), "wall_s": time.perf_counter() - wall0}
    per = len(seeds)
    return [_verified(c, runs[i * per:(i + 1) * per], cfg) for i, c in enumerate(cands)], info


def _twin_rank(c: Candidate, cfg: PlannerConfig) -> tuple[bool, float, float]:
    """Verified candidates by the twin: those meeting the constraints in the twin first, then the objective."""
    v = c.verified
    key = "cost_per_update_usd" if cfg.objective == "cost_per_update" else "cost_per_effective_update_usd"
    obj = v[key] if math.isfinite(v[key]) else math.inf
    return (not v["feasible"], obj, v["time_per_update_s"])
