"""Fidelity of the calibrated twin on a repo plan it did not see (issue 42 item 4).

1. A base policy for the repo task: `mixfleet pretrain --model tiny --task repo --demos 200 --steps 60
   --eval-episodes 0 --out BASE` (cached by its settings; reward 0 on held-out repositories, docs/tasks.md,
   which does not matter here: the timings, the tool calls and the sandboxes are what the twin predicts).
2. Run `data/plans/repo-cpu.toml` for real (run a: 24-sandbox pool, 3 samplers) and calibrate on it:
   `mixfleet calibrate A -o CAL --workload-out WL` (the samplers' and the trainer's fit, and the tool side of
   the workload: tool seconds, tool-output tokens, turns, sandbox start).
3. Run `data/plans/repo-cpu-xval.toml` for real (run b: bf16 x2, fp8 x1, nvfp4 x0, an 8-sandbox pool: the
   pool waits are real) and compare the twin calibrated on run a with it:
   `mixfleet fidelity data/plans/repo-cpu-xval.toml --runlog B --calibration CAL --workload WL --json`.
   Goals: time per update within 10 %, pool-wait share within 5 pp, sandbox cost per update within 10 %
   (a local run's sandboxes are free: its sandbox-seconds are priced at the plan's price per sandbox-hour,
   the twin's, twin/calibrated.py).

Writes benchmarks/results/repo_fidelity.json (every command that ran, the run settings, the figures, the goals
met or not, the machine's load) and the calibration and workload files next to it. Real runs take ~8 minutes
each on 2 shared cores. `--resume` keeps what is already done: a base in BASE, a run whose log has the updates
(an unfinished one continues with `mixfleet run --resume`); the calibration and fidelity always rerun (seconds).

    python benchmarks/repo_fidelity.py --updates 8
    python benchmarks/repo_fidelity.py --resume --run-a runs/repo-a --run-b runs/repo-b --base runs/base-repo
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mixfleet.costmodel.jsonsafe import json_safe

ROOT = Path(__file__).resolve().parents[1]
PLAN_A = "data/plans/repo-cpu.toml"
PLAN_B = "data/plans/repo-cpu-xval.toml"
RESULTS = ROOT / "benchmarks" / "results"
CLI = [sys.executable, "-m", "mixfleet.ui.cli"]


def _rel(p: Path) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def sh(args: list[str], commands: list[str], timeout_s: float | None = None) -> str:
    """Run `mixfleet ARGS` in the repository root, record the command line, return stdout (exit on failure)."""
    line = "mixfleet " + " ".join(shlex.quote(a) for a in args)
    commands.append(line)
    print(f"[repo-fidelity] {line}", flush=True)
    proc = subprocess.run(CLI + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise SystemExit(f"[repo-fidelity] failed (exit {proc.returncode}): {line}\n{tail}")
    return proc.stdout


def finished_updates(run: Path) -> int:
    """Updates a run log in `run` has finished (0: none, or no run log)."""
    from mixfleet.costmodel.records.runlog import RunLog

    if RunLog.not_a_run_log(run) is not None:
        return 0
    return len(RunLog.open(run).updates)


def real_run(plan: str, out: Path, updates: int, base: Path, resume: bool, commands: list[str],
             timeout_s: float) -> dict[str, Any]:
    """`mixfleet run PLAN` for real (no pass@k evaluation: it is not the plan's sampling work, and it would take
    sandboxes from the pool); with `resume` a finished run is kept and an unfinished one continues."""
    done = finished_updates(out)
    args = ["run", plan, "--out", _rel(out), "--updates", str(updates), "--init", _rel(base), "--eval-every", "0",
            "--quiet"]
    if resume and done >= updates:
        print(f"[repo-fidelity] {_rel(out)}: {done} updates already, kept", flush=True)
        return {"plan": plan, "runlog": _rel(out), "updates": done, "reused": True,
                "command": "mixfleet " + " ".join(args), "header": run_header(out)}
    if resume and done > 0:
        args.append("--resume")
    elif out.exists():
        args.append("--force")
    t0, load0 = time.time(), os.getloadavg()[0]
    sh(args, commands, timeout_s)
    return {"plan": plan, "runlog": _rel(out), "updates": updates, "reused": False, "command": commands[-1],
            "wall_s": time.time() - t0, "load_avg_1m_start": load0, "load_avg_1m_end": os.getloadavg()[0],
            "header": run_header(out)}


def run_header(run: Path) -> dict[str, Any]:
    """What the run log says about the run: its start time, wall seconds, update loop and the replicas it ran."""
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.costmodel.records.runsummary import summarize

    log = RunLog.open(run)
    s = summarize(log)
    runner = log.header.get("runner") or {}
    return {"created_utc": log.header.get("created_utc") or log.header.get("time_utc"), "elapsed_s": s.elapsed_s,
            "loop_s": s.elapsed_s - s.outside_loop_s, "time_per_update_mean_s": s.time_per_update_mean_s,
            "replicas": {g: (v or {}).get("replicas") for g, v in (runner.get("groups") or {}).items()}}


def trainer_pace(run: str) -> dict[str, float]:
    """The trainer's measured pace in a run (the same model and step on both plans): how fast the shared machine
    was during it, independent of the twin (a diagnostic, as benchmarks/fidelity.py's)."""
    from mixfleet.costmodel.records.runlog import RunLog

    up = RunLog.open(ROOT / run).updates
    tok, step = float(up["tokens"].sum()), float(up["train_step_s"].sum())
    return {"train_step_mean_s": step / max(len(up), 1), "train_tokens_per_s": tok / step if step > 0 else float("nan")}


def held_by_group(run: Path) -> dict[str, dict[str, float]]:
    """Per sampler group: episodes, sandbox-seconds and pool wait per episode (`runsummary.sandbox_use`)."""
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.costmodel.records.runsummary import sandbox_use

    tr = RunLog.open(run).trajectories
    out = {}
    for g, part in tr.groupby("group"):
        u = sandbox_use(part)
        out[str(g)] = {"episodes": u.episodes, "sandbox_s_per_episode": u.held_s / max(u.episodes, 1),
                       "wait_s_per_episode": u.wait_s / max(u.episodes, 1)}
    return out


def rescaled_diagnostic(cal: Path, wl: Path, run_b: Path, measured: dict, predicted: dict) -> dict[str, Any]:
    """Diagnostic only (it uses run b's own timings, so it is not a prediction): each group's fitted time scale
    multiplied by run b's measured / the twin's sandbox-seconds per episode, and the fidelity check again. If
    the pool-wait share then agrees, its miss comes from the groups' episode times in run b (the samplers'
    pace on the shared cores), not from the pool model."""
    from dataclasses import replace

    from mixfleet.costmodel.calibration.record import Calibration
    from mixfleet.twin.calibrated import fidelity

    c = Calibration.load(cal)
    k = {g: measured[g]["sandbox_s_per_episode"] / predicted[g]["sandbox_s_per_episode"]
         for g in measured if g in predicted and predicted[g]["sandbox_s_per_episode"] > 0}
    def scaled(g: Any) -> Any:
        f = k.get(g.name, 1.0)
        return replace(g, decode_scale=replace(g.decode_scale, value=g.decode_scale.value * f),
                       prefill_overhead_s=replace(g.prefill_overhead_s, value=g.prefill_overhead_s.value * f))

    groups = tuple(scaled(g) for g in c.groups)
    rep = fidelity(PLAN_B, run_b, replace(c, groups=groups), workload=wl)
    rows = {r.metric: r.to_dict() for r in rep.rows}
    return {"note": "diagnostic only, not a prediction: each group's fitted time scale x run b's measured / the "
                    "twin's sandbox-seconds per episode (run b's own timings), then the fidelity check again",
            "scale_factors": k, "figures": {m: rows[m] for m in ("time_per_update_mean_s", "sandbox_wait_share",
                                                                 "cost_sandbox_per_update_usd")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=8, help="Trainer updates per real run.")
    ap.add_argument("--run-a", type=Path, default=ROOT / "runs" / "repo-fid" / "a", help="Run a (repo-cpu).")
    ap.add_argument("--run-b", type=Path, default=ROOT / "runs" / "repo-fid" / "b", help="Run b (repo-cpu-xval).")
    ap.add_argument("--base", type=Path, default=ROOT / "runs" / "repo-fid" / "base", help="The base policy.")
    ap.add_argument("--resume", action="store_true", help="Keep the base and the runs already done.")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="Per real run.")
    ap.add_argument("--out", type=Path, default=RESULTS / "repo_fidelity.json")
    args = ap.parse_args()

    RESULTS.mkdir(parents=True, exist_ok=True)
    commands: list[str] = []
    base = args.base
    pretrain = ["pretrain", "--model", "tiny", "--task", "repo", "--demos", "200", "--steps", "60", "--eval-episodes",
                "0", "--out", _rel(base)]
    if not (args.resume and (base / "model.safetensors").exists()):
        sh(pretrain + (["--force"] if base.exists() else []), commands)
    runs = {"a": real_run(PLAN_A, args.run_a, args.updates, base, args.resume, commands, args.timeout_s)}
    cal = RESULTS / "repo-fidelity-calibration.toml"
    wl = RESULTS / "repo-fidelity-workload.toml"
    calibrate_text = sh(["calibrate", _rel(args.run_a), "-o", _rel(cal), "--workload-out", _rel(wl)], commands)
    runs["b"] = real_run(PLAN_B, args.run_b, args.updates, base, args.resume, commands, args.timeout_s)
    twin_b = args.run_b.parent / f"{args.run_b.name}-twin"
    shutil.rmtree(twin_b, ignore_errors=True)           # this script's own twin log of run b, written again below
    fid = json.loads(sh(["fidelity", PLAN_B, "--runlog", _rel(args.run_b), "--calibration", _rel(cal), "--workload",
                         _rel(wl), "--keep-twin-log", _rel(twin_b), "--json"], commands))
    # for contrast: the same twin with the calibration's own workload (no tool fit), and on run a (in sample)
    fid_cal_workload = json.loads(sh(["fidelity", PLAN_B, "--runlog", _rel(args.run_b), "--calibration", _rel(cal),
                                      "--json"], commands))
    in_sample = json.loads(sh(["fidelity", PLAN_A, "--runlog", _rel(args.run_a), "--calibration", _rel(cal),
                               "--workload", _rel(wl), "--json"], commands))

    def pick(rep: dict[str, Any]) -> dict[str, Any]:
        rows = {r["metric"]: r for r in rep["rows"]}
        return {k: rows[k] for k in ("time_per_update_mean_s", "sandbox_wait_share", "cost_sandbox_per_update_usd")
                if k in rows}

    g = fid["goals"]
    result = {
        "benchmark": "repo_fidelity", "issue": "42 item 4",
        "time_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "load_avg": list(os.getloadavg()),
                    "note": "2 cores shared with other work: real timings carry the machine's load"},
        "base_command": "mixfleet " + " ".join(pretrain), "commands": commands, "runs": runs,
        "calibration_file": _rel(cal), "workload_file": _rel(wl),
        "calibrate_output": [ln for ln in calibrate_text.splitlines()
                             if ln.startswith(("residuals:", "measured workload:", "calibration written"))],
        "goals": {"time_per_update_within_10pct": g["time_per_update_within_10pct"],
                  "time_per_update_rel_error": g["time_per_update_rel_error"],
                  "sandbox_wait_share_within_5pp": g.get("sandbox_wait_share_within_5pp"),
                  "sandbox_wait_share_error_pp": g.get("sandbox_wait_share_error_pp"),
                  "cost_sandbox_per_update_within_10pct": g.get("cost_sandbox_per_update_within_10pct"),
                  "cost_sandbox_per_update_rel_error": g.get("cost_sandbox_per_update_rel_error")},
        "figures": pick(fid),
        "machine_speed_check": {"a": trainer_pace(runs["a"]["runlog"]), "b": trainer_pace(runs["b"]["runlog"]),
                                "note": "diagnostic only: the trainer's tokens/s in each run (the same work), so a "
                                        "different pace between a and b is the shared machine's load"},
        "cross_validation": fid,
        "by_group_run_b": {"measured": held_by_group(ROOT / runs["b"]["runlog"]), "twin": held_by_group(twin_b)},
        "cross_validation_calibration_workload": {"figures": pick(fid_cal_workload), "goals": fid_cal_workload["goals"],
                                                  "notes": fid_cal_workload["notes"]},
        "in_sample": {"figures": pick(in_sample), "goals": in_sample["goals"], "notes": in_sample["notes"]},
    }
    bg = result["by_group_run_b"]
    result["diagnostic_group_pace_of_run_b"] = rescaled_diagnostic(cal, wl, ROOT / runs["b"]["runlog"], bg["measured"],
                                                                   bg["twin"])
    args.out.write_text(json.dumps(json_safe(result), indent=2) + "\n")
    for label, rep in (("cross-validation (repo-cpu-xval, run b)", fid), ("in-sample (repo-cpu, run a)", in_sample),
                       ("xval, the calibration's own workload", fid_cal_workload)):
        print(f"\n== {label}")
        for name, r in pick(rep).items():
            print(f"  {name:32s} measured {r['measured']!s:>24}  predicted {r['predicted']!s:>24}  error {r['error']}"
                  f" ({r['error_kind']})")
        print("  goals:", json.dumps(json_safe(rep["goals"])))
    print(f"\n[repo-fidelity] wrote {_rel(args.out)}")


if __name__ == "__main__":
    main()
