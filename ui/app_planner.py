"""Adapter between the Plan page and the mix planner (`mixfleet.planner`).

`run(...)` turns the page's inputs (model, workload, price table, the edited accelerator pool with its
prices per GPU-hour and allowed precisions, constraints) into a `PlannerConfig`, calls `plan_mix` (`verify`
candidates verified in the twin's steady state and re-ranked; every default is the planner's one set,
`planner.defaults.DEFAULTS`, the same as `mixfleet plan`'s), dry-runs the chosen plan
in the twin (its per-group share of samples shown), and evaluates the seed's two fleets with the planner's
analytic model (`evaluate_plan`) as reference points, and dry-runs them in the twin too (warm starts; their
steady state). The dry runs are the twin's checks (`twin.checks.twin_check` through `default_map`: at once on
this machine's cores, each read back from the check cache when asked before; the chosen mix's is the planner's
own verification job, read back). It returns a `PlannerView` for the page: the chosen plan as
TOML, the chosen mix as a display table, the Pareto set, and the twin's points. Planning happens in
mixfleet.planner (its candidates checked by the twin's `twin_check`, handed in here) and simulation in
mixfleet.twin; here only inputs and outputs are shaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd
import tomli_w
from mixfleet.costmodel.specs.formats import formats
from mixfleet.planner.defaults import DEFAULTS
from mixfleet.ui.app_common import (
    REFERENCE_PLANS,
    PlanText,
    fmt_compact,
    fmt_num,
    fmt_pct,
    fmt_usd,
    plan_object,
    shipped_plan,
    with_workload,
)

PLANNER_MODULE = "mixfleet.planner.search"
# The page's defaults are the planner's one set (`mixfleet plan` plans with the same; the page shows them).
DEFAULT_MAX_GPUS = DEFAULTS.default_max_gpus
DEFAULT_MAX_STALENESS = DEFAULTS.max_staleness or 0.0        # versions; 0 = no limit
DEFAULT_MAX_TIME_S = DEFAULTS.max_time_per_update_s or 0.0   # seconds per update; 0 = no limit
DEFAULT_BUDGET_USD_H = DEFAULTS.max_usd_per_hour or 0.0      # USD per hour; 0 = no limit
# the Plan page's names for the limits (its field labels), by the CLI flag `what binds` would otherwise say
LABEL_STALENESS = "max mean staleness (versions, 0 = none)"
LABEL_TIME = "max time per update (s, 0 = none)"
LABEL_BUDGET = "budget (USD per hour, 0 = none)"
PAGE_NAMES = {"--max-staleness": "max mean staleness", "--max-time-per-update": "max time per update",
              "--budget": "budget (USD per hour)", "--max-gpus": "max GPUs"}
DEFAULT_TWIN_UPDATES = DEFAULTS.verify_updates   # updates per twin check (0: 10 + prompts in flight / per update,
                                                 # warm start), for the verification and the page's dry runs
DEFAULT_VERIFY = DEFAULTS.verify                 # candidates plan_mix verifies and re-ranks in the twin
OBJECTIVES = {"cost per update": "cost_per_update",
              "cost per effective update (masked tokens count as waste)": "cost_per_effective_update"}
KV_DTYPES = formats().sglang_kv_dtypes   # the GPU servers' KV dtypes (data/precisions.toml)


@dataclass(frozen=True)
class PlannerView:
    plan: PlanText
    mix_table: pd.DataFrame                      # one row per group, values formatted with units
    chosen_point: dict[str, Any]                 # the planner's numbers for the chosen mix
    points: pd.DataFrame                         # the Pareto set
    references: list[dict[str, Any]] = field(default_factory=list)  # the seed fleets, planner's analytic model
    twin_points: list[dict[str, Any]] = field(default_factory=list)  # twin dry runs (chosen + seed fleets)
    notes: str = ""
    binds: str = ""                              # what keeps the chosen mix from a cheaper one (planner.binds_text)
    # the seed fleets' twin dry runs still to make (`finish_twin_points`): (name, plan dict) each, and the
    # (updates, seed, calibration) of every twin point
    pending_twin: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    twin_job: tuple[int, int, Any] = (0, 0, None)


def available() -> bool:
    try:
        import mixfleet.planner.search  # noqa: F401
    except ImportError:
        return False
    return True


def unavailable_reason() -> str:
    return f"`{PLANNER_MODULE}` cannot be imported in this installation."


def precision_list(v: Any) -> list[str]:
    """A pool cell of precisions (a list from the multiselect, or comma-separated text) as a list."""
    if v is None or isinstance(v, float):
        return []
    items = v.split(",") if isinstance(v, str) else list(v)
    return [str(p).strip() for p in items if str(p).strip()]


def pool_overrides(pool: pd.DataFrame, price_table: str) -> tuple[dict[str, float], dict[str, tuple[str, ...]]]:
    """What the edited pool changes against the price table and the native precisions: (prices per GPU-hour
    for every row whose price was edited, allowed precisions for ticked rows whose list was edited)."""
    from mixfleet.costmodel.specs.catalog import load_catalog

    cat = load_catalog(price_table)
    prices: dict[str, float] = {}
    precisions: dict[str, tuple[str, ...]] = {}
    for row in pool.to_dict("records"):
        acc = cat.accelerator(str(row["accelerator"]))
        usd = row.get("usd_per_gpu_hour")
        if usd is None or isinstance(usd, float) and math.isnan(usd):
            usd = 0.0  # an emptied cell: the planner refuses it, naming the field
        if not math.isclose(float(usd), acc.price_usd_per_gpu_hour, rel_tol=1e-9):
            prices[acc.name] = float(usd)
        if "precisions" in row and bool(row.get("use", True)):
            chosen = precision_list(row["precisions"])
            native = [p for p in cat.precisions if cat.support(acc.name, p) == "native"]
            if sorted(chosen) != sorted(native):
                precisions[acc.name] = tuple(chosen)
    return prices, precisions


def check_pool(pool: pd.DataFrame, price_table: str, emulated: bool = False) -> None:
    """Validate the edited pool's prices and precisions with the planner's config (raises its SpecError)."""
    from mixfleet.planner.config import PlannerConfig

    prices, precisions = pool_overrides(pool, price_table)
    PlannerConfig(price_table=price_table, prices=prices, precisions=precisions, emulated=emulated)


def _point(c: Any) -> dict[str, Any]:
    stale = c.staleness if math.isfinite(c.staleness) else math.nan
    mix = ", ".join(f"{g} x{n}" for g, n in c.replicas.items())
    box = c.cost_sandbox_per_update_usd if math.isfinite(c.cost_sandbox_per_update_usd) else 0.0
    share = box / c.cost_per_update_usd if box > 0 and c.cost_per_update_usd > 0 else 0.0
    return {"time_per_update_s": c.time_per_update_s, "cost_per_update_usd": c.cost_per_update_usd,
            "cost_sandbox_per_update_usd": box, "sandbox_share": share,
            "cost_sampling_per_update_usd": c.cost_sampling_per_update_usd,
            "cost_training_per_update_usd": c.cost_training_per_update_usd,
            "sandbox_wait_share": c.sandbox_wait_share, "sandboxes_live": c.sandboxes_live,
            "cost_per_effective_update_usd": c.cost_per_effective_update_usd, "staleness_mean": stale,
            "usd_per_hour": c.usd_per_hour, "inflight_prompts": c.inflight_prompts,
            "trainer_bound": c.trainer_bound, "throughput_tokens_per_s": c.throughput_tokens_per_s,
            "label": f"{mix}; {c.inflight_prompts} prompts in flight"
                     + (f"; sandboxes {fmt_usd(box)} per update ({fmt_pct(share)} of it)" if box > 0 else "")
                     + ("; trainer-bound (staleness unbounded)" if c.trainer_bound else "")}


def _twin_point(name: str, check: dict[str, Any]) -> dict[str, Any]:
    """A twin check's steady state (`twin.checks.twin_check`) as a point of the Pareto chart."""
    return {"name": name, "time_per_update_s": check["time_per_update_s"],
            "time_per_update_ci_s": check["time_per_update_ci_s"], "cost_per_update_usd": check["cost_per_update_usd"],
            "cost_per_update_ci_usd": check["cost_per_update_ci_usd"], "staleness_mean": check["staleness"],
            "staleness_ci": check["staleness_ci"],
            "cost_sandbox_per_update_usd": check.get("cost_sandbox_per_update_usd", 0.0)}


def _load_calibration(path: str) -> Any:
    from mixfleet.costmodel.calibration.record import Calibration

    return Calibration.load(path)


def run(*, model: str, workload: str, price_table: str, pool: pd.DataFrame, kv_dtypes: tuple[str, ...],
        trainer_accelerator: str, trainer_gpus: int, max_staleness: float | None,
        max_time_per_update_s: float | None, budget_usd_per_hour: float | None, objective: str,
        twin_updates: int = DEFAULT_TWIN_UPDATES, references: bool = True, seed: int = DEFAULTS.seed,
        emulated: bool = DEFAULTS.emulated, calibration: str | None = None,
        progress: Callable[[float, str], None] | None = None, backend: str = DEFAULTS.backend,
        layouts: str = DEFAULTS.layouts, verify: int = DEFAULT_VERIFY, sandboxes: bool = False,
        sandbox_cap: int | None = None, sandbox_start_s: float | None = None,
        sandbox_usd_per_hour: float | None = None) -> PlannerView:
    """Plan a mix; raises the planner's SpecError on bad inputs and ValueError when nothing is feasible.
    `pool`: columns use, accelerator, max_gpus and optionally usd_per_gpu_hour and precisions (edited prices
    and precision lists become the planner's per-accelerator overrides; `emulated` allows emulated ones)."""
    from mixfleet.planner.config import PlannerConfig
    from mixfleet.planner.search import binds_text, plan_mix, verify_updates
    from mixfleet.policies.plan import with_overrides
    from mixfleet.twin.checks import default_map, twin_check

    say = progress or (lambda _f, _m: None)
    used = pool[pool["use"].astype(bool)]
    prices, precisions = pool_overrides(pool, price_table)
    cfg = PlannerConfig(
        model=model, workload=workload, price_table=price_table, accelerators=tuple(used["accelerator"]),
        max_gpus={str(a): int(n) for a, n in zip(used["accelerator"], used["max_gpus"], strict=True)},
        kv_dtypes=tuple(kv_dtypes), trainer_accelerator=trainer_accelerator, trainer_gpus=int(trainer_gpus),
        max_staleness=max_staleness, max_time_per_update_s=max_time_per_update_s,
        max_usd_per_hour=budget_usd_per_hour, objective=OBJECTIVES.get(objective, objective), verify=verify,
        verify_updates=twin_updates, seed=seed,
        prices=prices, precisions=precisions, emulated=emulated,
        calibration=_load_calibration(calibration) if calibration else None, backend=backend, layouts=layouts,
        sandboxes=sandboxes, sandbox_cap=sandbox_cap, sandbox_usd_per_hour=sandbox_usd_per_hour,
        **({"sandbox_start_s": sandbox_start_s} if sandbox_start_s is not None else {}))
    if not cfg.accelerators:
        from mixfleet.costmodel.errors import SpecError

        raise SpecError("accelerator pool", "use", "none ticked", "at least one accelerator")
    say(0.02, "planner: starting")
    result = plan_mix(cfg, progress=lambda m: say(0.05 if m == "group types" else 0.15, f"planner: {m}"),
                      check=twin_check, check_map=default_map)
    if result.best is None or result.plan is None:
        raise ValueError(f"no plan: {result.note or 'no feasible candidate'} "
                         f"({result.screened} candidates screened, {result.feasible} feasible)")
    plan = result.plan
    pt = PlanText(plan.name, tomli_w.dumps(plan.to_dict()))
    best = result.best
    if not twin_updates:   # automatic, as the verification: the chosen mix's 10 + prompts in flight / per update
        from mixfleet.costmodel.specs.workload import load_workload

        twin_updates = verify_updates(best, cfg, load_workload(workload).prompts_per_update)
    jobs: list[tuple[str, dict[str, Any]]] = [("chosen mix (twin)", plan.to_dict())]
    analytic: list[dict[str, Any]] = []
    if references:
        from mixfleet.planner.search import evaluate_plan

        say(0.18, "planner: the seed's fleets")
        for ref in REFERENCE_PLANS:  # the seed's sampler fleets on this model, workload, prices and trainer
            rp = with_overrides(plan_object(with_workload(shipped_plan(ref), workload)), {
                "model": model, "price_table": price_table, "trainer.accelerator": trainer_accelerator,
                "trainer.gpus": int(trainer_gpus), **{f"prices.{a}": usd for a, usd in cfg.prices.items()}})
            analytic.append({"name": ref, **_point(evaluate_plan(rp))})
            jobs.append((f"{ref} (twin)", rp.to_dict()))
    # the chosen mix's twin point: the planner's own verification job (same plan, updates, seed and calibration),
    # read back from the check cache, not simulated again (simulated here only when verify is 0). The seed fleets'
    # dry runs are left to finish_twin_points, so that a page can show the plan before they end.
    say(0.2, f"twin: the chosen mix, {twin_updates} updates from a warm start")
    checks, _info = default_map(twin_check, [(jobs[0][1], twin_updates, seed, cfg.calibration)])
    twin_points = [_twin_point(jobs[0][0], checks[0])]
    chosen_check = checks[0]
    types = {t.name: t for t in result.types}
    share = chosen_check.get("group_share_of_samples", {})
    rows = []
    for g in plan.groups:
        t = types[g.name]
        rows.append({"group": g.name, "accelerator": g.accelerator, "precision": g.precision, "KV cache": g.kv_dtype,
                     "replicas": g.replicas, "TP (GPUs/replica)": t.tp, "GPUs": g.replicas * t.tp,
                     "USD/h": fmt_usd(g.replicas * t.usd_per_hour), "tokens/s (planner)":
                     fmt_compact(g.replicas * t.tokens_per_s), "share of samples (twin)": fmt_pct(share.get(g.name)),
                     "prior share outside [0.2, 5]": fmt_pct(t.masked_share, 3),
                     "layout": (f"TP{t.tp}" if t.dp_attention == 1 and t.ep == 1 else
                                f"{t.tp} GPUs, DP {t.dp_attention}, EP {t.ep}"),
                     "priced by": "measured (aiconfigurator)" if t.backend == "aiconfigurator" else t.backend})
    table = pd.DataFrame(rows)
    chosen = _point(best)
    cs = chosen_check
    chosen["twin"] = {  # the chosen plan's steady state in the twin (its check above)
        "time_per_update_s": cs["time_per_update_s"], "time_per_update_ci_s": cs["time_per_update_ci_s"],
        "cost_per_update_usd": cs["cost_per_update_usd"], "cost_per_update_ci_usd": cs["cost_per_update_ci_usd"],
        "cost_sandbox_per_update_usd": cs["cost_sandbox_per_update_usd"], "sandbox_wait_share": cs[
            "sandbox_wait_share"], "staleness": cs["staleness"], "staleness_ci": cs["staleness_ci"],
        "fill_s": cs["fill_s"], "warmup_updates": cs["warmup_updates"], "steady_updates": cs["steady_updates"],
        "updates": twin_updates}
    points = pd.DataFrame([_point(c) for c in result.pareto])
    points["pareto"] = True
    notes = (f"{result.screened:,} candidates screened, {result.feasible:,} feasible, {len(result.pareto)} on the "
             f"Pareto set; {best.inflight_prompts} prompts in flight; fleet throughput "
             f"{fmt_num(best.throughput_tokens_per_s, 'tokens/s')} (planner). "
             + (f"The {len(result.verified)} best by the analytic screen were verified in the twin's steady state "
                "and re-ranked by it. " if result.verified else "")
             + ("" if result.verified else "(No candidate was verified in the twin: verify is 0.) ")
             + f"Twin points: {twin_updates} updates each from a warm start, their steady state (the pipeline fill "
             "and the MSER-5 warm-up left out).")
    if best.trainer_bound:
        notes += " The chosen mix is trainer-bound: samplers outpace the trainer and staleness grows without bound."
    say(1.0, "done")
    return PlannerView(plan=pt, mix_table=table, chosen_point=chosen, points=points, references=analytic,
                       twin_points=twin_points, notes=notes, binds=binds_text(result.binds, PAGE_NAMES),
                       pending_twin=jobs[1:], twin_job=(twin_updates, seed, cfg.calibration))


def finish_twin_points(view: PlannerView, progress: Callable[[float, str], None] | None = None) -> PlannerView:
    """`view` with the seed fleets' twin points that `run` left to make: their dry runs at once on this machine's
    cores, each read back from the check cache when asked before. A view with none pending comes back as it is."""
    if not view.pending_twin:
        return view
    from mixfleet.twin.checks import default_map, twin_check

    updates, seed, calibration = view.twin_job
    if progress is not None:
        progress(0.0, f"twin: the seed's {len(view.pending_twin)} fleets, {updates} updates each from a warm start")
    checks, _info = default_map(twin_check, [(d, updates, seed, calibration) for _, d in view.pending_twin])
    points = [_twin_point(name, c) for (name, _), c in zip(view.pending_twin, checks, strict=True)]
    if progress is not None:
        progress(1.0, "done")
    return replace(view, twin_points=[*view.twin_points, *points], pending_twin=[])
