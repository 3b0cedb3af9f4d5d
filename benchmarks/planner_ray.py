"""The planner's twin checks, one after another in this process vs as Ray tasks (issue 27 item 5).

On the seed's model and workload with the planner's defaults (planner/defaults.py), the analytic screen runs
once; then its best K candidates (K = 3, the default, and K = 12) are verified in the twin's steady state
(`planner.search.verify_candidates`, one `twin.checks.twin_check` per candidate) twice: sequentially
(`sequential_map`) and as Ray tasks on a local Ray of this machine's CPUs (`ray_map`, what `mixfleet plan
--workers 0` does, Ray's start included in the wall time). Recorded per K and mode: wall seconds, tasks, workers
and nodes that ran them, and whether the verified figures are identical to the sequential ones. The machine's
load average is recorded beside them: on a shared 2-core machine the wall times say more about the neighbours
than about Ray.

    nice -n 15 python benchmarks/planner_ray.py [--ks 3,12] [--workers 0] [--out benchmarks/results/planner_ray.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
from mixfleet.costmodel.jsonsafe import json_safe
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import feasible, group_types
from mixfleet.planner.search import _candidate, screen, sequential_map, verify_candidates
from mixfleet.runner.orchestration.ray_map import ray_map
from mixfleet.twin.checks import twin_check

OUT = Path(__file__).resolve().parent / "results" / "planner_ray.json"


def top_candidates(cfg: PlannerConfig, k: int) -> tuple[list, list]:
    """The screen's best k feasible candidates by the objective (plan_mix's order) and the group types."""
    types = group_types(cfg)
    n, kk, m = screen(types, cfg)
    idx = np.flatnonzero(feasible(m, cfg))
    order = idx[np.lexsort((m["time_per_update_s"][idx], m[cfg.objective][idx]))]
    return [_candidate(types, n[i], kk[i], m, i) for i in order[:k]], types


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="3,12", help="comma-separated numbers of candidates to verify")
    ap.add_argument("--workers", type=int, default=0, help="local Ray CPUs (0: this machine's)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    ks = [int(x) for x in args.ks.split(",")]
    cfg = PlannerConfig()
    t0 = time.perf_counter()
    cands, types = top_candidates(cfg, max(ks))
    screen_s = time.perf_counter() - t0
    rows = []
    for k in ks:
        ref = None
        for mode, check_map in (("sequential", sequential_map),
                                ("ray", functools.partial(ray_map, workers=args.workers))):
            load0 = os.getloadavg()
            done, info = verify_candidates(cands[:k], types, cfg, check=twin_check, check_map=check_map)
            figures = [c.verified for c in done]
            if mode == "sequential":
                ref = figures
            rows.append({"k": k, "mode": mode, **info, "load_average_before": load0,
                         "load_average_after": os.getloadavg(), "identical_to_sequential": figures == ref,
                         "best_by_twin": min(range(k), key=lambda i: figures[i]["cost_per_update_usd"]),
                         "cost_per_update_usd": [f["cost_per_update_usd"] for f in figures]})
            print(json.dumps({x: rows[-1][x] for x in ("k", "mode", "tasks", "workers", "nodes", "wall_s",
                                                      "identical_to_sequential")}), flush=True)
            out = {"benchmark": "planner_ray", "config": "planner defaults (seed model and workload)",
                   "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "note": "shared machine: "
                               "see load_average_* (1, 5, 15 min) per row"}, "screen_s": screen_s,
                   "candidates": [c.replicas for c in cands], "rows": rows,
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(json_safe(out), indent=2) + "\n")   # after every row
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
