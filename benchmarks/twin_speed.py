"""Twin and planner speed at the seed's scale (1,024 trajectories per update, ~67 turns each on average).

Runs `simulate` on data/plans/seed-mixed.toml for --updates updates (default 200, the goal's run, cold start)
and `mixfleet plan`'s default search (the default pool, `--plan-verify` candidates verified in the twin's
steady state), and prints and writes (benchmarks/results/twin_speed.json): simulated events per second, wall
and CPU seconds of the run and per steady update, a 200-update projection when --updates is shorter, whether
the twin's core ran compiled, and the planner's time. Goal (issues 3, 15): 200 updates < 60 s, plan < 60 s,
one core. Wall seconds depend on how busy the machine is; CPU seconds are reported next to them.

    python benchmarks/twin_speed.py [--updates 200] [--plan-verify 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import mixfleet.twin.core as core
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.search import evaluate_plan, plan_mix
from mixfleet.policies.plan import load_plan
from mixfleet.twin.checks import default_map, twin_check
from mixfleet.twin.sim import simulate

OUT = Path(__file__).resolve().parent / "results" / "twin_speed.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=200)
    ap.add_argument("--plan-verify", type=int, default=3, help="candidates the planner verifies in the twin")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()

    c0, w0 = time.process_time(), time.perf_counter()
    marks: list[tuple[int, float, float]] = []
    log = args.out.parent / "twin_speed_runlog"
    shutil.rmtree(log, ignore_errors=True)

    def progress(v: int) -> None:
        marks.append((v, time.perf_counter() - w0, time.process_time() - c0))
        if v % 20 == 0 or v == args.updates:  # a 200-update run takes a minute or more: say where it is
            print(f"update {v}/{args.updates}: {marks[-1][2]:.1f} CPU-s", file=sys.stderr, flush=True)

    r = simulate("seed-mixed", updates=args.updates, out=log, progress=progress)
    cpu_s, wall_s = time.process_time() - c0, time.perf_counter() - w0
    half = len(marks) // 2       # steady state: the second half of the updates (the first ones fill the pipeline)
    (v0, w_a, c_a), (v1, w_b, c_b) = marks[half - 1], marks[-1]
    steady_wall, steady_cpu = (w_b - w_a) / (v1 - v0), (c_b - c_a) / (v1 - v0)
    if len(marks) >= 200:  # measured, not projected: the wall and CPU seconds at the 200th update
        proj_wall, proj_cpu = marks[199][1], marks[199][2]
    else:
        proj_wall, proj_cpu = w_a + steady_wall * (200 - v0), c_a + steady_cpu * (200 - v0)
    sim = {"plan": "seed-mixed", "updates": args.updates, "core_compiled": core.COMPILED,
           "trajectories_per_update": 1024,
           "turns_mean_per_trajectory": float(r.summary.turns_mean), "events": r.events,
           "wall_s": wall_s, "cpu_s": cpu_s, "events_per_wall_s": r.events / wall_s,
           "events_per_cpu_s": r.events / cpu_s,
           "steady_wall_s_per_update": steady_wall, "steady_cpu_s_per_update": steady_cpu,
           "200_updates_measured": len(marks) >= 200,
           "projected_200_updates_wall_s": proj_wall, "projected_200_updates_cpu_s": proj_cpu,
           "simulated_time_per_update_s": r.summary.time_per_update_mean_s,
           "staleness_mean": r.summary.staleness_mean}
    est = evaluate_plan(load_plan("seed-mixed"))  # the twin's steady state (runsummary), next to the analytic model
    sim["steady_simulated_time_per_update_s"] = r.summary.steady_time_per_update_s
    sim["steady_simulated_time_per_update_ci_s"] = r.summary.steady_time_per_update_ci_s
    sim["steady_staleness_mean"] = r.summary.steady_staleness_mean
    sim["warmup_updates"] = r.summary.warmup_updates
    sim["analytic_time_per_update_s"] = est.time_per_update_s
    sim["analytic_staleness_mean"] = est.staleness
    shutil.rmtree(log, ignore_errors=True)
    print(json.dumps(sim, indent=2))

    c0, w0 = time.process_time(), time.perf_counter()
    res = plan_mix(PlannerConfig(verify=args.plan_verify), check=twin_check, check_map=default_map)
    plan = {"verify": args.plan_verify, "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
            "screened": res.screened, "feasible": res.feasible,
            "best": res.best.replicas if res.best else None}
    print(json.dumps(plan, indent=2))
    out = {"simulate": sim, "plan": plan,
           "goal": {"200_updates_s": 60, "plan_s": 60},
           "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                       "load_avg_1m": os.getloadavg()[0]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
