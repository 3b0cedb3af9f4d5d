"""Benchmark: does `calibrate` recover time scales it is given? The twin runs a plan with known per-group decode
scales (far from the priors), its run log is calibrated, and each fitted scale is compared with the truth.

Why (issue 42 item 3): tests/test_calibration.py does this on the tiny CPU plan, whose decode step is flat in the
batch and whose contexts are short, so a bias of the duration fit in concurrency or context never shows there. The
seed's own workload (57 turns, contexts of tens of thousands of tokens) on GPUs whose KV holds only part of the
sessions is where it matters. Each plan is simulated with `--updates` updates; the truth is the scales
1.3, 0.8, 1.1, 1.2, 0.9, 1.05 (cycled over the plan's groups; `twin.replan.perturbed_truth`: the rest at
the priors), the plan's own workload.

    python benchmarks/calibration_selftest.py [--plans seed-mixed,tests-agentic] [--updates 30]

`tests-agentic` is tests/test_calibration.py's AGENTIC_PLAN (three GPU groups; 20 updates there). Results:
benchmarks/results/calibration_selftest.json (per plan and group: truth, fitted, stderr, relative error, the
group's duration residual; the turn latency fitted or measured; the commit).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))             # tests/test_calibration.py: AGENTIC_PLAN
RESULTS = ROOT / "benchmarks" / "results" / "calibration_selftest.json"
SCALES = (1.3, 0.8, 1.1, 1.2, 0.9, 1.05)


def selftest(plan: Any, updates: int) -> dict[str, Any]:
    from mixfleet.costmodel.calibration.fit import calibrate
    from mixfleet.twin.rates import build_setup
    from mixfleet.twin.replan import perturbed_truth
    from mixfleet.twin.sim import simulate

    truth = {g.name: SCALES[i % len(SCALES)] for i, g in enumerate(plan.groups)}
    cal = perturbed_truth(plan, slower={g: 1.0 / d for g, d in truth.items()})    # decode_scale = d, else priors
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        simulate(plan, updates=updates, out=Path(tmp) / "log", setup=build_setup(plan, calibration=cal))
        sim_s = time.perf_counter() - t0
        fitted = calibrate([Path(tmp) / "log"])
    rows = {}
    for g in plan.groups:
        f = fitted.group(g.name)
        rows[g.name] = {"truth": truth[g.name], "fitted": f.decode_scale.value, "stderr": f.decode_scale.stderr,
                        "rel_error": f.decode_scale.value / truth[g.name] - 1.0,
                        "duration_rel_rms": f.residual_rel_rms, "trajectories": f.trajectories}
    tau = fitted.turn_latency_s
    return {"updates": updates, "simulate_s": sim_s, "groups": rows,
            "max_abs_rel_error": max(abs(r["rel_error"]) for r in rows.values()),
            "turn_latency_s": {"value": tau.value, "stderr": tau.stderr, "note": tau.note}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans", default="seed-mixed,tests-agentic")
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    from mixfleet.policies.plan import load_plan, plan_from_dict

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    out: dict[str, Any] = {"benchmark": "calibration_selftest", "commit": commit,
                           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "plans": {}}
    for name in args.plans.split(","):
        if name == "tests-agentic":
            from test_calibration import AGENTIC_PLAN
            plan = plan_from_dict(AGENTIC_PLAN)
        else:
            plan = load_plan(name)
        res = selftest(plan, args.updates)
        out["plans"][name] = res
        print(f"{name} ({args.updates} updates): largest error {res['max_abs_rel_error']:+.1%}; turn latency "
              f"{res['turn_latency_s']['value']:.3f} s")
        for g, r in res["groups"].items():
            print(f"  {g:>20}: truth {r['truth']:.2f} fitted {r['fitted']:.3f} +- {r['stderr']:.3f} "
                  f"({r['rel_error']:+.1%}), duration residual {r['duration_rel_rms']:.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
