"""The re-planner on the real runner (issue 27 item 3): a real CPU run that moves replicas away from a degraded group.

data/plans/replan-cpu.toml: two embedded CPU sampler groups with one prior (BF16 weights and KV, the same
accelerator and price), cpu-fast computing in FP32 and cpu-slow in BF16 (slower on this CPU than the prior, which
does not know the kernel), started fast x1, slow x2, each free in [0, 2]; `[policies.autoscaler] name = "replan"`.
The same plan static (data/plans/replan-cpu-static.toml: the fixed autoscaler). Three real runs, one after the
other (`mixfleet run PLAN --out DIR --updates N --quiet`: the embedded engine, a local Ray, the Megatron-core
trainer): re-planned, static, re-planned again (the shared machine's pace drifts, so the static run sits between
two re-planned ones, and each run's trainer pace, trained tokens per second of its step, is reported: the same
work in every run). For each: the `replan` events (before / after counts, fitted values with stderr, predicted
gain) and the decisions the current solver makes on the same log (`replay`), the mix over time (replicas up per
group per update), cost per update and per effective update (cost / (1 - extreme share)) over the whole run and
over the updates after the first adopted re-plan (the static run: after the first re-planned run's), time per
update, staleness.

Resumable: a run folder whose run log already has N updates is measured as it is; one that stopped short is
continued (`--resume`); the results are written after each run.

    nice -n 10 python benchmarks/replan_real.py [--updates 16] [--work /work/runs/replan] [--table]

Writes benchmarks/results/replan_real.json and prints the table (docs/runner.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from mixfleet.costmodel.jsonsafe import json_safe
from mixfleet.costmodel.records.runlog import EventRecord, GroupRecord, RunLog, TrajectoryRecord, UpdateRecord
from mixfleet.costmodel.records.runsummary import summarize
from mixfleet.planner.solver import solver_for
from mixfleet.policies.plan import plan_from_dict
from mixfleet.policies.registry import make
from mixfleet.policies.replan import replan_decisions
from mixfleet.runner.orchestration.launcher import run_argv

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "replan_real.json"
# the runs in the order they are made: the static run between two re-planned ones, since the shared machine's
# pace drifts (the trainer's tokens/s of each run is reported beside it)
PLANS = {"replanned": ROOT / "data" / "plans" / "replan-cpu.toml",
         "static": ROOT / "data" / "plans" / "replan-cpu-static.toml",
         "replanned2": ROOT / "data" / "plans" / "replan-cpu.toml"}


def updates_done(d: Path) -> int:
    """Updates in the run log at `d` (0 when there is none)."""
    if RunLog.not_a_run_log(d) is not None:
        return 0
    return len(RunLog.open(d).updates)


def real_run(plan: Path, d: Path, updates: int, timeout_s: float) -> dict[str, Any]:
    """Run (or continue) `plan` into `d` until it has `updates` updates; the wall seconds and the machine's load."""
    done = updates_done(d)
    if done >= updates:
        return {"reused": True, "updates": done}
    argv = run_argv(plan, d, updates=updates, resume=done > 0 or (d / "trainer_state").exists())
    t0, load0 = time.time(), os.getloadavg()[0]
    print(f"[replan_real] {' '.join(argv[2:])}", flush=True)
    with (d.parent / f"{d.name}.log").open("ab") as log:
        proc = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        raise SystemExit(f"[replan_real] {plan.name} into {d} failed (exit {proc.returncode}); see {d}.log")
    return {"reused": False, "updates": updates_done(d), "wall_s": round(time.time() - t0, 1),
            "load_avg_1m_start": load0, "load_avg_1m_end": os.getloadavg()[0]}


def measure(d: Path, first_v: int | None) -> dict[str, Any]:
    """One run log: totals over the run and over the updates after version `first_v` (None: all)."""
    log = RunLog.open(d)
    s = summarize(log)
    up = log.updates.sort_values("version").reset_index(drop=True)
    cost = (up["cost_sampler_usd"] + up["cost_trainer_usd"]).to_numpy(dtype=float)
    v = up["version"].to_numpy()
    tok = up["tokens"].to_numpy(dtype=float)
    ext = up["extreme_share"].to_numpy(dtype=float)
    st = up["staleness_mean"].to_numpy(dtype=float)

    def over(i0: int) -> dict[str, float]:
        """Updates i0+1 .. last (the cost and time between update i0's end and the last one's)."""
        n = len(up) - i0 - 1
        if n <= 0:
            return {"updates": 0}
        sl = slice(i0 + 1, len(up))
        e = float(np.nansum(ext[sl] * tok[sl]) / tok[sl].sum())
        cpu = float((cost[-1] - cost[i0]) / n)
        return {"updates": n, "cost_per_update_usd": cpu, "extreme_share": e,
                "cost_per_effective_update_usd": cpu / (1.0 - e),
                "time_per_update_s": float((up["end_s"].iloc[-1] - up["end_s"].iloc[i0]) / n),
                "staleness_mean": float((st[sl] * tok[sl]).sum() / tok[sl].sum())}

    i0 = 0 if first_v is None else int(np.searchsorted(v, first_v))
    whole_e = float(np.nansum(ext * tok) / tok.sum())
    mix = {str(g): [round(float(x), 2) for x in gr.sort_values("version")["replicas_up"]]
           for g, gr in log.groups.groupby("group")}
    ev = log.events
    scale = ev[ev["kind"].isin(["scale_up", "scale_down", "cold_start", "ready"])]
    return {"updates": len(up), "status": log.header.get("status"),
            "whole_run": {"cost_per_update_usd": s.cost_per_update_usd, "extreme_share": whole_e,
                          "cost_per_effective_update_usd": s.cost_per_update_usd / (1.0 - whole_e),
                          "time_per_update_s": s.time_per_update_mean_s, "staleness_mean": s.staleness_mean,
                          "trainer_idle_share": s.trainer_idle_share},
            "after_first_replan": over(i0), "share_of_samples": dict(s.group_share_of_samples),
            "mix_replicas_up_by_update": mix, "versions": [int(x) for x in v],
            "scale_events": [{"time_s": round(float(e.time_s), 1), "kind": e.kind, "group": e.group,
                              "version": int(e.version)} for e in scale.itertuples()],
            "decisions": [_decision(x) for x in replan_decisions(ev)],
            "decisions_replayed_with_current_solver": replay(d)}


class _Reader:
    """What `Replan.attach` needs of a run-log writer: the header, and a hook for its observer."""

    def __init__(self, header: dict[str, Any]) -> None:
        self.header: dict[str, Any] = header
        self.observer: Any = None

    def observe(self, fn: Any) -> None:
        self.observer = fn


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    """A frame row as a record's keyword arguments (numpy scalars as Python ones)."""
    def py(x: Any) -> Any:
        if isinstance(x, dict):
            return {py(k): py(v) for k, v in x.items()}
        return x.item() if hasattr(x, "item") else x
    return {k: py(v) for k, v in row.items()}


def replay(d: Path) -> list[dict[str, Any]]:
    """The run log's records fed, update by update in the order the runner wrote them (the update's trajectories,
    the events up to its end, its group rows, then the update), to a fresh `replan` autoscaler of the log's plan
    with the current solver (`planner.solver.solver_for`): the decisions the current code makes on this real run's
    measurements (the run itself followed the decisions of the code it ran with, in its `replan` events)."""
    log = RunLog.open(d)
    plan = plan_from_dict(log.header["plan"])
    ref = plan.policies.autoscaler
    if ref.name != "replan":
        return []
    rp = make("autoscaler", ref.name, ref.settings)
    reader = _Reader(log.header)
    rp.attach(reader, solver_for(plan))
    tr, gr, ev = log.trajectories, log.groups, log.events.sort_values("time_s", kind="stable")
    out, prev = [], -math.inf
    for u in log.updates.sort_values("version").to_dict("records"):
        v, end = int(u["version"]), float(u["end_s"])
        rows = [*tr[(tr["trained_version"] == v) | ((tr["trained_version"] < 0) & (tr["end_s"] > prev)
                                                    & (tr["end_s"] <= end))].to_dict("records")]
        recs: list[Any] = [TrajectoryRecord(**_plain(r)) for r in rows]
        recs += [EventRecord(**_plain(r)) for r in ev[(ev["time_s"] > prev) & (ev["time_s"] <= end)
                                                       & (ev["kind"] != "replan")].to_dict("records")]
        recs += [GroupRecord(**_plain(r)) for r in gr[gr["version"] == v].to_dict("records")]
        recs.append(UpdateRecord(**_plain(u)))
        for rec in recs:
            for back in reader.observer(rec) or ():
                out.append(_decision({"version": int(back.version), "time_s": float(back.time_s),
                                      **json.loads(back.detail)}))
        prev = end
    return out


def _decision(d: dict[str, Any]) -> dict[str, Any]:
    fit = d.get("fitted") or {}
    return {"version": d["version"], "time_s": round(d["time_s"], 1), "adopted": d["adopted"],
            "reason": d["reason"], "trigger": d["trigger"], "before": d["before"], "after": d["after"],
            "gain": d["gain"], "predicted": d.get("predicted", {}),
            "decode_scale": {g: f["decode_scale"] for g, f in fit.items() if g != "trainer"},
            "fitted": fit}


def table(res: dict[str, Any]) -> str:
    """The Markdown table docs/runner.md shows."""
    rows = ["| run | counts (start -> end) | updates | USD / update (whole run) | USD / effective update (whole "
            "run) | USD / effective update (after 1st re-plan) | time / update (s) | staleness | trainer tokens/s "
            "| USD / eff. update after, at the static run's pace |", "|---|---|---|---|---|---|---|---|---|---|"]
    for kind in PLANS:
        m = res["runs"].get(kind)
        if not m:
            continue
        mix = m["mix_replicas_up_by_update"]
        counts = ", ".join(f"{g} {xs[0]:g} -> {xs[-1]:g}" for g, xs in mix.items())
        w, a = m["whole_run"], m["after_first_replan"]
        rows.append(f"| {kind} | {counts} | {m['updates']} | {w['cost_per_update_usd']:.3g} | "
                    f"{w['cost_per_effective_update_usd']:.3g} | {a.get('cost_per_effective_update_usd', math.nan):.3g}"
                    f" | {w['time_per_update_s']:.1f} / {a.get('time_per_update_s', math.nan):.1f} after | "
                    f"{w['staleness_mean']:.2f} | {m.get('trainer_tokens_per_s', math.nan):.0f} | "
                    f"{a.get('cost_per_effective_update_at_static_pace_usd', math.nan):.3g} |")
    out = ["\n".join(rows)]
    for kind in (k for k in PLANS if PLANS[k] == PLANS["replanned"] and k in res["runs"]):
        re = res["runs"][kind]
        out.append(f"\n{kind}:")
        out.append("\n| update | adopted | before | after | fitted decode_scale (+- stderr) | predicted gain | "
                   "reason |")
        out.append("|---|---|---|---|---|---|---|")
        for d in re["decisions"]:
            ds = ", ".join(f"{g} {v[0]:.2f} +- {v[1]:.2f}" for g, v in d["decode_scale"].items()
                           if v[0] is not None and v[1] is not None)
            gain = d["gain"]
            out.append(f"| {d['version']} | {d['adopted']} | {d['before']} | {d['after']} | {ds} | "
                       f"{'—' if gain is None else f'{gain:+.1%}'} | {d['reason']} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=16)
    ap.add_argument("--work", default="/work/runs/replan")
    ap.add_argument("--only", default="", help="comma-separated runs: " + ", ".join(PLANS))
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--table", action="store_true", help="print the table of the results file and stop")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(OUT.read_text())))
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    res = json.loads(OUT.read_text()) if OUT.exists() else {}
    res.setdefault("runs", {})
    res.setdefault("runs_meta", {})
    res.update(benchmark="replan_real", updates=args.updates, work=str(work),
               plans={k: str(p.relative_to(ROOT)) for k, p in PLANS.items()},
               command=f"nice -n 10 python benchmarks/replan_real.py --updates {args.updates} --work {work}",
               python=sys.version.split()[0])
    kinds = args.only.split(",") if args.only else list(PLANS)
    for kind in kinds:
        res["runs_meta"][kind] = real_run(PLANS[kind], work / kind, args.updates, args.timeout_s)
        _measure_all(res, work)
        res["time_utc"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(json_safe(res), indent=1))
    print(table(res))


def first_adopted(d: Path) -> int | None:
    adopted = [x for x in replan_decisions(RunLog.open(d).events) if x["adopted"]] if updates_done(d) else []
    return adopted[0]["version"] if adopted else None


def _measure_all(res: dict[str, Any], work: Path) -> None:
    """Every run measured over the updates after its first adopted re-plan (the static run: after the first
    re-planned run's), with the trainer's pace (trained tokens per second of its step: the same work in every run,
    so how fast the shared machine was) and the cost at the static run's pace (a diagnostic)."""
    first = {k: first_adopted(work / k) for k in PLANS if PLANS[k] == PLANS["replanned"]}
    res["first_adopted_replan_version"] = first
    for kind in PLANS:
        if updates_done(work / kind):
            res["runs"][kind] = measure(work / kind, first.get(kind, first.get("replanned")))
            res["runs"][kind]["trainer_tokens_per_s"] = trainer_pace(work / kind)
    ref = res["runs"].get("static", {}).get("trainer_tokens_per_s")
    for m in res["runs"].values():
        a = m["after_first_replan"]
        if ref and a.get("updates"):
            # a run on a machine running at pace p took ref / p as long per unit of work as it would have at ref
            a["cost_per_effective_update_at_static_pace_usd"] = (a["cost_per_effective_update_usd"]
                                                                 * m["trainer_tokens_per_s"] / ref)


def trainer_pace(d: Path) -> float:
    """Trained tokens per second of the trainer's step over the run (updates after the first two)."""
    up = RunLog.open(d).updates.sort_values("version").iloc[2:]
    return float(up["tokens"].sum() / up["train_step_s"].sum())


if __name__ == "__main__":
    main()
