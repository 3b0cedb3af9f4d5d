"""The twin with a Calibration, and the fidelity check: does the twin predict what a real run did?

A calibrated dry run is `simulate(plan, calibration=cal)` (or `simulate_calibrated(plan, cal)`): the world's
setup is `rates.build_setup(plan, calibration=cal)`, the same function as an uncalibrated run's, with the
fitted values in place of the priors for the groups the calibration covers (costmodel/plan/planspec.py
`resolve_groups`: each group's replica model through `GroupCalibration.apply`, weight-sync time, mismatch),
the trainer's step time when the calibration was made on the plan's trainer accelerator, and the measured
workload. Routing weights stay the prior's, because that is what the real runner routes with
(runner/orchestration/fleet.py).

`fidelity(plan, runlog, calibration)` simulates the plan with the run's seed, number of updates, replica
counts (an embedded rehearsal scales groups down; the twin simulates what actually ran) and workload,
and lays predicted next to measured: time per update (mean, p95), per-group tokens/s and share of
samples, mean staleness, trainer idle share, per-group KL and extreme-ratio share, cost per update.
Time per update is measured from the start of the update loop (the runner's start-up, before the first
prompt, is not the plan's behaviour; the twin starts with its replicas up). A group's tokens/s counts the
generated tokens of the logged (trained or dropped) trajectories over that span, the same on both sides.

A plan with sandboxes (a [sandbox] table, or a repo plan's pool: `planspec.plan_sandbox`) adds two rows, each from
the logged episodes by one definition on both sides (`runsummary.sandbox_use`): the pool-wait share (waits /
(waits + sandbox-seconds)) and the sandbox cost per update (the logged episodes' sandbox-seconds at the plan's
price per sandbox-hour, its own or the catalog's, / updates: a local run's sandboxes are free, so they are priced
as the twin prices them). Both worlds start with no episode in flight and neither logs the episodes still in
flight at the end, so the definitions match; the twin's own billing (every live sandbox, those in flight at the
end included) is shown in a note. `workload=` (`mixfleet fidelity --workload`, e.g. `mixfleet calibrate
--workload-out`'s fit) replaces the workload the twin draws episodes from (the calibration's, or the plan's).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mixfleet.costmodel.calibration.record import Calibration
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.costmodel.records.runsummary import loop_clock, sandbox_use, summarize
from mixfleet.costmodel.specs.workload import WorkloadSpec, load_workload
from mixfleet.policies.plan import Plan, load_plan, plan_from_dict, with_overrides
from mixfleet.twin.rates import build_setup


def plan_as_run(plan: Plan, log: RunLog) -> Plan:
    """The plan with each group's replica count set to what the run really started (embedded rehearsals
    scale groups down; the runner header records `runner.groups.<name>.replicas`)."""
    ran = (log.header.get("runner") or {}).get("groups") or {}
    over: dict[str, Any] = {}
    for g in plan.groups:
        info = ran.get(g.name)
        if isinstance(info, dict) and isinstance(info.get("replicas"), int) and info["replicas"] != g.replicas:
            n = int(info["replicas"])
            over[f"groups.{g.name}.min_replicas"] = min(g.min_replicas, n)
            over[f"groups.{g.name}.max_replicas"] = n
            over[f"groups.{g.name}.replicas"] = n
    if not over:
        return plan
    # replicas first lowered together with its bounds (with_overrides validates the merged plan once)
    return with_overrides(plan, over)


def rehearsal_not_modelled(header: dict[str, Any]) -> str:
    """Why the twin cannot predict this run log, or "": an embedded rehearsal (runner fleet_mode "embedded") of a
    plan whose samplers name accelerators other than CPUs ran those samplers on this machine's CPU cores, while
    the run log's plan (runner/orchestration/rehearsal.py keeps each group's accelerator, for its prices) still
    names the GPUs; the twin would simulate the GPUs (issue 44: tokens/s +146,405 %, time/update +1247 %)."""
    from mixfleet.costmodel.specs.catalog import load_catalog

    runner = header.get("runner") or {}
    plan = header.get("plan") or {}
    if header.get("source") != "runner" or runner.get("fleet_mode") != "embedded" or not isinstance(plan, dict):
        return ""
    try:
        cat = load_catalog(plan.get("price_table") or None)
        gpus = sorted({str(g.get("accelerator")) for g in plan.get("groups", [])
                       if cat.accelerator(str(g.get("accelerator"))).kind != "cpu"})
    except (SpecError, KeyError, ValueError):
        return ""
    if not gpus:
        return ""
    return (f"this run is an embedded rehearsal on this machine's CPU cores of a plan whose samplers are "
            f"{', '.join(gpus)}; the twin simulates {', '.join(gpus)} replicas, not the CPU samplers that ran, so "
            "its predictions (fidelity, overlays, predicted vs measured) do not apply to this run (a run of a CPU "
            "plan, e.g. tiny-cpu, or a real run on the plan's accelerators can be checked)")


# ---- the comparison -------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class FidelityRow:
    metric: str
    measured: float
    predicted: float
    unit: str = ""
    kind: str = "rel"                # "rel": relative error; "pp": difference in percentage points; "abs"

    @property
    def error(self) -> float:
        """Relative error (predicted - measured) / |measured|, or the difference for kind "pp" / "abs"."""
        a, b = self.measured, self.predicted
        if not (math.isfinite(a) and math.isfinite(b)):
            return math.nan
        if self.kind == "pp":
            return 100.0 * (b - a)
        if self.kind == "abs":
            return b - a
        return 0.0 if a == b else ((b - a) / abs(a) if a != 0 else math.nan)

    def to_dict(self) -> dict[str, Any]:
        def clean(x: float) -> float | None:
            return float(x) if math.isfinite(x) else None
        return {"metric": self.metric, "measured": clean(self.measured), "predicted": clean(self.predicted),
                "unit": self.unit, "error": clean(self.error),
                "error_kind": {"rel": "relative", "pp": "percentage points", "abs": "difference"}[self.kind]}


@dataclass(frozen=True, kw_only=True)
class FidelityReport:
    plan: str
    runlog: str
    calibration: str                 # path or "" (priors)
    updates: int
    seed: int
    rows: list[FidelityRow]
    notes: list[str] = field(default_factory=list)
    twin_runlog: str = ""

    def row(self, metric: str) -> FidelityRow:
        for r in self.rows:
            if r.metric == metric:
                return r
        raise KeyError(metric)

    def goals(self) -> dict[str, Any]:
        """The cross-validation goals: time/update within 10%, share of samples within 3 pp, staleness 0.5; with
        sandboxes also the pool-wait share within 5 pp and the sandbox cost per update within 10%."""
        t = self.row("time_per_update_mean_s").error
        shares = [abs(r.error) for r in self.rows if r.metric.startswith("share_of_samples[")]
        st = self.row("staleness_mean").error
        sandbox: dict[str, Any] = {}
        if any(r.metric == "sandbox_wait_share" for r in self.rows):
            w, c = self.row("sandbox_wait_share").error, self.row("cost_sandbox_per_update_usd").error
            sandbox = {"sandbox_wait_share_within_5pp": bool(math.isfinite(w) and abs(w) <= 5.0),
                       "sandbox_wait_share_error_pp": w if math.isfinite(w) else None,
                       "cost_sandbox_per_update_within_10pct": bool(math.isfinite(c) and abs(c) <= 0.10),
                       "cost_sandbox_per_update_rel_error": c if math.isfinite(c) else None}
        return {"time_per_update_within_10pct": bool(math.isfinite(t) and abs(t) <= 0.10),
                "time_per_update_rel_error": t if math.isfinite(t) else None,
                "share_of_samples_within_3pp": bool(shares and max(shares) <= 3.0),
                "share_of_samples_max_error_pp": max(shares) if shares else None,
                "staleness_within_half_update": bool(math.isfinite(st) and abs(st) <= 0.5),
                "staleness_error_updates": st if math.isfinite(st) else None, **sandbox}

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan, "runlog": self.runlog, "calibration": self.calibration, "updates": self.updates,
                "seed": self.seed, "rows": [r.to_dict() for r in self.rows], "goals": self.goals(),
                "notes": list(self.notes)}


def run_metrics(path: str | Path, sandbox_usd_per_hour: float | None = None) -> dict[str, Any]:
    """The fidelity metrics of one run log (the same definitions for the twin and the runner); with
    `sandbox_usd_per_hour` (a plan with sandboxes) also its pool-wait share and sandbox cost per update from its
    logged episodes (`runsummary.sandbox_use`)."""
    log = RunLog.open(path)
    s = summarize(log)
    span = s.elapsed_s - s.outside_loop_s      # the update loop's seconds
    # the summary's loop clock: per run segment, a resumed run's start-ups are not the plan's behaviour
    out: dict[str, Any] = {
        "time_per_update_mean_s": s.time_per_update_mean_s,
        "time_per_update_p95_s": s.time_per_update_p95_s,
        "staleness_mean": s.staleness_mean,
        "trainer_idle_share": s.trainer_idle_share,
        "cost_per_update_usd": s.cost_per_update_usd,
        "cost_sampler_per_update_usd": s.cost_sampler_per_update_usd,
        "kl_k3": s.kl_k3, "extreme_share": s.extreme_share,
        "groups": {},
    }
    tr = log.trajectories
    if sandbox_usd_per_hour is not None:
        use = sandbox_use(tr)
        out["sandbox_wait_share"] = use.wait_share
        out["cost_sandbox_per_update_usd"] = use.cost_per_update_usd(sandbox_usd_per_hour, len(log.updates))
        out["sandbox_s_per_episode"] = use.held_s / use.episodes if use.episodes else math.nan
    for g in s.group_share_of_samples:
        # tokens of the logged (trained or dropped) trajectories: the runner credits a group's tokens when a
        # session ends, the twin as they are generated, so the groups table's counts are not comparable
        tok = float(tr.loc[tr["group"] == g, "generated_tokens"].sum()) if len(tr) else math.nan
        out["groups"][g] = {"tokens_per_s": tok / span if span > 0 else math.nan,
                            "share_of_samples": s.group_share_of_samples.get(g, math.nan),
                            "kl_k3": s.group_kl_k3.get(g, math.nan),
                            "extreme_share": s.group_extreme_share.get(g, math.nan)}
    return out


def compare_metrics(measured: dict[str, Any], predicted: dict[str, Any]) -> list[FidelityRow]:
    rows = [FidelityRow(metric="time_per_update_mean_s", measured=measured["time_per_update_mean_s"],
                        predicted=predicted["time_per_update_mean_s"], unit="s"),
            FidelityRow(metric="time_per_update_p95_s", measured=measured["time_per_update_p95_s"],
                        predicted=predicted["time_per_update_p95_s"], unit="s"),
            FidelityRow(metric="staleness_mean", measured=measured["staleness_mean"],
                        predicted=predicted["staleness_mean"], unit="versions", kind="abs"),
            FidelityRow(metric="trainer_idle_share", measured=measured["trainer_idle_share"],
                        predicted=predicted["trainer_idle_share"], unit="share", kind="pp"),
            FidelityRow(metric="cost_per_update_usd", measured=measured["cost_per_update_usd"],
                        predicted=predicted["cost_per_update_usd"], unit="USD"),
            FidelityRow(metric="cost_sampler_per_update_usd", measured=measured["cost_sampler_per_update_usd"],
                        predicted=predicted["cost_sampler_per_update_usd"], unit="USD"),
            FidelityRow(metric="kl_k3", measured=measured["kl_k3"], predicted=predicted["kl_k3"], unit="nats/token"),
            FidelityRow(metric="extreme_share", measured=measured["extreme_share"],
                        predicted=predicted["extreme_share"], unit="share", kind="pp")]
    if "sandbox_wait_share" in measured:
        rows += [FidelityRow(metric="sandbox_wait_share", measured=measured["sandbox_wait_share"],
                             predicted=predicted["sandbox_wait_share"], unit="share", kind="pp"),
                 FidelityRow(metric="cost_sandbox_per_update_usd", measured=measured["cost_sandbox_per_update_usd"],
                             predicted=predicted["cost_sandbox_per_update_usd"], unit="USD"),
                 FidelityRow(metric="sandbox_s_per_episode", measured=measured["sandbox_s_per_episode"],
                             predicted=predicted["sandbox_s_per_episode"], unit="s")]
    for g in sorted(set(measured["groups"]) | set(predicted["groups"])):
        m, p = measured["groups"].get(g, {}), predicted["groups"].get(g, {})
        for key, unit, kind in (("tokens_per_s", "tokens/s", "rel"), ("share_of_samples", "share", "pp"),
                                ("kl_k3", "nats/token", "rel"), ("extreme_share", "share", "pp")):
            rows.append(FidelityRow(metric=f"{key}[{g}]", measured=m.get(key, math.nan),
                                    predicted=p.get(key, math.nan), unit=unit, kind=kind))
    return rows


def _comparable(d: dict[str, Any]) -> dict[str, Any]:
    """A plan dict without the fields that do not change what runs (name, description)."""
    return {k: v for k, v in d.items() if k not in ("name", "description")}


def fidelity(plan: Plan | str | Path | None, runlog: str | Path, calibration: Calibration | str | Path | None = None, *,
             keep_twin_log: str | Path | None = None, price_table: str | None = None,
             workload: WorkloadSpec | str | Path | None = None) -> FidelityReport:
    """Simulate `plan` as `runlog` ran it (seed, updates, replica counts, workload) and compare.
    plan None: the plan recorded in the run log's header. `workload` (a spec or a TOML path): the workload the
    twin draws episodes from, in place of the calibration's or the plan's (batch sizes and context the plan's)."""
    from mixfleet.twin.sim import simulate

    why = RunLog.not_a_run_log(runlog)
    if why is not None:
        raise SpecError("fidelity", "runlog", str(runlog), f"a run log folder (this one: {why})")
    log = RunLog.open(runlog)
    n = len(log.updates)
    if n < 1:
        raise SpecError("fidelity", "runlog", str(runlog), "a run log with at least one finished update")
    if why := rehearsal_not_modelled(log.header):
        raise SpecError("fidelity", "runlog", str(runlog), f"a run the twin models ({why})")
    notes: list[str] = []
    ran = log.header.get("plan")
    if plan is None:
        if not isinstance(ran, dict):
            raise SpecError("fidelity", "plan", None, "a plan (the run log's header has none)")
        plan_name, plan = "(the run log's plan)", plan_from_dict(ran)
    else:
        plan_name = str(plan)
        plan = plan if isinstance(plan, Plan) else load_plan(plan)
        if isinstance(ran, dict) and _comparable(plan.to_dict()) != _comparable(ran):
            notes.append("the plan differs from the one in the run log's header (pass plan=None / omit it to "
                         "simulate the header's)")
    plan = plan_as_run(plan, log)
    cal = calibration if isinstance(calibration, Calibration) or calibration is None else Calibration.load(calibration)
    wl = workload if isinstance(workload, WorkloadSpec) or workload is None else load_workload(workload)
    setup = build_setup(plan, price_table=price_table, calibration=cal, workload=wl)
    if cal is not None:
        notes += setup.notes
    else:
        notes.append("no calibration: the cost model's priors" + ("" if wl is not None else " and the plan's workload"))
    if wl is not None:
        notes.append(f"the twin's workload: {workload if not isinstance(workload, WorkloadSpec) else wl.name}")
    sb = setup.sandbox
    if sb is not None:
        notes.append(f"sandboxes: at most {sb.max_live} live, {sb.start_s:.3g} s to start, priced at "
                     f"${sb.usd_per_hour:.4g} per sandbox-hour ({sb.price_source}) on both sides")
    price = sb.usd_per_hour if sb is not None else None
    seed = int(log.header.get("seed", plan.seed))
    out = Path(keep_twin_log) if keep_twin_log is not None else Path(tempfile.mkdtemp(prefix="mixfleet-fid-"))
    if out.exists() and keep_twin_log is not None:
        shutil.rmtree(out)
    try:
        simulate(replace(plan, seed=seed), updates=n, seed=seed, out=out, price_table=price_table, setup=setup)
        predicted = run_metrics(out, price)
        if sb is not None:
            notes.append("cost_per_update_usd: the twin's includes its sandboxes, a local run's does not (they are "
                         "free); compare cost_sampler_per_update_usd and cost_sandbox_per_update_usd")
            notes.append(f"the twin's own billing (every live sandbox, those in flight at the end included): "
                         f"{summarize(out).cost_sandbox_per_update_usd:.4g} USD of sandboxes per update")
    finally:
        if keep_twin_log is None:
            shutil.rmtree(out, ignore_errors=True)
    measured = run_metrics(runlog, price)
    clock = loop_clock(log)
    if log.header.get("source") == "runner" and clock.segments > 1:
        s = summarize(log)
        notes.append(f"measured on the update loop of its {clock.segments} segments (stopped or killed, then resumed): "
                     f"{s.elapsed_s - clock.span_s:.1f} s of start-ups and stops left out, as on the run's card "
                     f"(its time per update, {s.time_per_update_mean_s:.2f} s, is measured on the same loop; its "
                     f"tokens/s divides by all {s.elapsed_s:.1f} s)")
    if log.header.get("source") == "runner":
        up = log.updates
        if len(up) and float(up["cost_trainer_usd"].fillna(0).max()) == 0.0:
            notes.append("the run log has no trainer cost (cost_trainer_usd = 0): compare cost_sampler_per_update")
    return FidelityReport(plan=plan_name, runlog=str(runlog), calibration=(cal.source_path if cal else ""),
                          updates=n, seed=seed, rows=compare_metrics(measured, predicted), notes=notes,
                          twin_runlog=str(keep_twin_log) if keep_twin_log else "")


def simulate_calibrated(plan: Plan | str | Path, calibration: Calibration | str | Path, **kwargs: Any) -> Any:
    """`twin.sim.simulate` with a Calibration (object or TOML path) in place of the priors; kwargs as simulate's
    (updates, seed, out, price_table, progress). Returns its TwinResult."""
    from mixfleet.twin.sim import simulate

    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    cal = calibration if isinstance(calibration, Calibration) else Calibration.load(calibration)
    return simulate(plan, calibration=cal, **kwargs)
