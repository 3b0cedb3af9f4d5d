"""Cross-validation of the calibrated twin on this machine: calibrate on one real run, predict another.

1. Run `data/plans/tiny-cpu.toml` for real (`mixfleet run`, embedded samplers, a few updates).
2. `calibrate` on its run log (the fitted values go to benchmarks/results/fidelity-calibration.toml).
3. In-sample check: the calibrated twin replays tiny-cpu (same seed, updates, workload) vs the run.
4. Run `data/plans/tiny-cpu-xval.toml` for real: other replica counts per group (bf16 x2, fp8 x1, nvfp4 x0)
   and another router (least outstanding tokens).
5. Out-of-sample: the twin calibrated on run 1 predicts run 2 (it sees only run 2's seed, number of updates
   and replica counts, which a plan fixes in advance); also the uncalibrated twin (priors) for contrast.

Writes benchmarks/results/fidelity.json: per metric measured / predicted / error, the goals (time per update
within 10%, share of samples within 3 pp, mean staleness within 0.5 updates), the settings, the machine's
load average. Real runs take minutes each on 2 shared cores; `--reuse-a DIR` / `--reuse-b DIR` skip a run.

    python benchmarks/fidelity.py --updates 6
    python benchmarks/fidelity.py --reuse-a runs/fid/a --reuse-b runs/fid/b
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mixfleet.costmodel.jsonsafe import json_safe

ROOT = Path(__file__).resolve().parents[1]
PLAN_A = ROOT / "data" / "plans" / "tiny-cpu.toml"
PLAN_B = ROOT / "data" / "plans" / "tiny-cpu-xval.toml"
RESULTS = ROOT / "benchmarks" / "results"


def real_run(plan: Path, out: Path, updates: int, timeout_s: float, retries: int = 2) -> dict[str, Any]:
    """`mixfleet run PLAN --out OUT --updates N` in a subprocess (no pass@k evaluation: it is not the plan's
    sampling work), retried from scratch when it fails (a local Ray can time out starting on a loaded
    machine); returns the wall seconds, attempts and the machine's load."""
    cmd = [sys.executable, "-m", "mixfleet.ui.cli", "run", str(plan), "--out", str(out), "--updates", str(updates),
           "--eval-every", "0", "--quiet"]
    for attempt in range(1, retries + 2):
        shutil.rmtree(out, ignore_errors=True)      # a fresh run log each attempt
        t0 = time.time()
        load0 = os.getloadavg()[0]
        print(f"[fidelity] {' '.join(cmd[2:])} (attempt {attempt})", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, timeout=timeout_s, capture_output=True, text=True)
        if proc.returncode == 0:
            return {"plan": str(plan.relative_to(ROOT)), "runlog": str(out), "updates": updates, "attempts": attempt,
                    "wall_s": time.time() - t0, "load_avg_1m_start": load0, "load_avg_1m_end": os.getloadavg()[0]}
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        print(f"[fidelity] the real run of {plan.name} failed (exit {proc.returncode}):\n{tail}", flush=True)
    raise SystemExit(f"[fidelity] the real run of {plan.name} failed {retries + 1} times")


def _trainer_pace(runlog: Path) -> dict[str, float]:
    """The trainer's measured pace in a run (same model, same step on both plans): how fast the shared machine
    was during it, independent of the twin. A different pace between runs a and b is machine load."""
    from mixfleet.costmodel.records.runlog import RunLog

    up = RunLog.open(runlog).updates
    tok, step = float(up["tokens"].sum()), float(up["train_step_s"].sum())
    return {"train_step_mean_s": step / max(len(up), 1), "tokens_per_update": tok / max(len(up), 1),
            "train_tokens_per_s": tok / step if step > 0 else math.nan}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=6, help="Trainer updates per real run.")
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs" / "fidelity", help="Where the real runs go.")
    ap.add_argument("--reuse-a", type=Path, default=None, help="Use this tiny-cpu run log instead of running.")
    ap.add_argument("--reuse-b", type=Path, default=None, help="Use this tiny-cpu-xval run log instead of running.")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="Per real run.")
    ap.add_argument("--concurrent", action="store_true", help="Run both plans at the same time (same load).")
    ap.add_argument("--out", type=Path, default=RESULTS / "fidelity.json")
    args = ap.parse_args()

    from mixfleet.costmodel.calibration.fit import calibrate
    from mixfleet.twin.calibrated import fidelity

    RESULTS.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = {}
    a = args.reuse_a or args.runs_dir / "a"
    b = args.reuse_b or args.runs_dir / "b"
    if args.concurrent and args.reuse_a is None and args.reuse_b is None:
        # both real runs at once: they see the same machine load (run b is still predicted from run a only)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(real_run, PLAN_A, a, args.updates, args.timeout_s)
            fb = pool.submit(real_run, PLAN_B, b, args.updates, args.timeout_s)
            runs["a"], runs["b"] = fa.result(), fb.result()
    elif args.reuse_a is None:
        runs["a"] = real_run(PLAN_A, a, args.updates, args.timeout_s)
    cal = calibrate([a])
    cal_path = cal.save(RESULTS / "fidelity-calibration.toml")
    print(f"[fidelity] calibration written to {cal_path}", flush=True)
    in_sample = fidelity(None, a, cal)      # the plan as the run recorded it (plan files may change)

    if "b" not in runs and args.reuse_b is None:
        runs["b"] = real_run(PLAN_B, b, args.updates, args.timeout_s)
    out_sample = fidelity(None, b, cal)
    priors = fidelity(None, b, None)

    result = {
        "benchmark": "fidelity", "time_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "load_avg": list(os.getloadavg()), "note": "2 cores shared with other "
                    "work: real timings carry the machine's load"},
        "mode": "concurrent" if args.concurrent else "sequential", "runs": runs, "calibrated_on": str(a),
        "calibration_file": str(cal_path.relative_to(ROOT)),
        "calibration": {f"{scope}.{name}": {"value": f.value, "stderr": f.stderr, "prior": f.prior,
                                            "fitted": f.fitted} for scope, name, f in cal.table()},
        "calibration_residuals": cal.residuals,
        "in_sample": in_sample.to_dict(),
        "cross_validation": out_sample.to_dict(),
        "cross_validation_with_priors": priors.to_dict(),
    }
    pace = {k: _trainer_pace(p) for k, p in (("a", a), ("b", b))}
    ratio = pace["b"]["train_tokens_per_s"] / pace["a"]["train_tokens_per_s"]
    t = out_sample.row("time_per_update_mean_s")
    result["machine_speed_check"] = {
        **pace, "pace_ratio_b_over_a": ratio,
        "note": "diagnostic only (uses run b's trainer pace, so it is not a prediction): the twin's time per "
                "update divided by how much faster the shared machine ran during b than during a",
        "time_per_update_rel_error_pace_adjusted": t.predicted / ratio / t.measured - 1.0}
    args.out.write_text(json.dumps(json_safe(result), indent=2) + "\n")
    for label, rep in (("in-sample (tiny-cpu)", in_sample), ("cross-validation (tiny-cpu-xval)", out_sample),
                       ("xval with priors", priors)):
        print(f"\n== {label}")
        for r in rep.rows:
            err = r.error
            e = "—" if not math.isfinite(err) else (f"{err:+.1%}" if r.kind == "rel" else
                                                     f"{err:+.2f} pp" if r.kind == "pp" else f"{err:+.3g}")
            print(f"  {r.metric:40s} measured {r.measured:12.5g}  predicted {r.predicted:12.5g}  error {e}")
        print("  goals:", json.dumps(json_safe(rep.goals())))
    print(f"\n[fidelity] wrote {args.out}")


if __name__ == "__main__":
    main()
