"""`mixfleet plan`'s wall time with its defaults, as a person runs it (issue 43 item 4: a plan in seconds).

Runs `mixfleet plan --json` as a whole process --runs times in each mode and prints and writes
(benchmarks/results/planner_speed.json) each run's wall seconds, the median, and the chosen mix and its twin
figures:

- cold: an empty check cache for every run (`MIXFLEET_CACHE_DIR` a fresh folder): the twin checks run on this
  machine's cores (`twin.checks.local_map`), as on a fresh clone;
- cached: the same inputs asked again (the app's Plan page, a second `mixfleet plan`): the twin checks read back
  from the cache (`twin.checks.cached_map`);
- sequential (--sequential): `MIXFLEET_NO_CACHE=1` and one core (`taskset -c 0`), the checks one after another
  as before the change.

Wall seconds depend on how busy the machine is: the 1-minute load average is written beside them.

    python benchmarks/planner_speed.py [--runs 3] [--sequential]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "planner_speed.json"


def one(env: dict[str, str], prefix: list[str]) -> tuple[float, dict]:
    w0 = time.perf_counter()
    p = subprocess.run([*prefix, "mixfleet", "plan", "--json"], env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - w0, json.loads(p.stdout)


def mode(name: str, runs: int, *, fresh_cache: bool, no_cache: bool = False, one_core: bool = False) -> dict:
    walls, last, cache = [], {}, tempfile.mkdtemp(prefix="mixfleet-plan-cache-")
    loads = []
    try:
        if not fresh_cache and not no_cache:
            one({**os.environ, "MIXFLEET_CACHE_DIR": cache}, [])   # fill the cache once (not counted)
        for _ in range(runs):
            if fresh_cache:
                shutil.rmtree(cache, ignore_errors=True)
            env = {**os.environ, "MIXFLEET_CACHE_DIR": cache}
            if no_cache:
                env["MIXFLEET_NO_CACHE"] = "1"
            loads.append(os.getloadavg()[0])
            wall, last = one(env, ["taskset", "-c", "0"] if one_core else [])
            walls.append(wall)
            print(f"{name}: {wall:.1f} s wall (load {loads[-1]:.1f})", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    v = last.get("best", {}).get("verified", {})
    return {"runs": walls, "median_wall_s": statistics.median(walls), "load_avg_1m": loads,
            "checks": last.get("checks"), "best": last.get("best", {}).get("replicas"),
            "twin_time_per_update_s": v.get("time_per_update_s"),
            "twin_time_per_update_ci_s": v.get("time_per_update_ci_s"),
            "twin_cost_per_update_usd": v.get("cost_per_update_usd"),
            "twin_cost_per_update_ci_usd": v.get("cost_per_update_ci_usd")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sequential", action="store_true", help="also time one core without the cache")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    out = {"command": "mixfleet plan --json (defaults)",
           "cold": mode("cold", args.runs, fresh_cache=True),
           "cached": mode("cached", args.runs, fresh_cache=False)}
    if args.sequential:
        out["sequential"] = mode("sequential", args.runs, fresh_cache=True, no_cache=True, one_core=True)
    out["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                      "date": time.strftime("%Y-%m-%d", time.gmtime())}
    print(json.dumps(out, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
