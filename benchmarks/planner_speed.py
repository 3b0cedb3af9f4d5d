"""`mixfleet plan`'s wall time with its defaults, as a person runs it (issue 43 item 4: a plan in seconds).

Runs `mixfleet plan --json` as a whole process --runs times in each mode and prints and writes
(benchmarks/results/planner_speed.json) each run's wall seconds, the median, and the chosen mix and its twin
figures:

- cold: an empty check cache for every run (`MIXFLEET_CACHE_DIR` a fresh folder): the twin checks run on this
  machine's cores (`twin.checks.local_map`), as on a fresh clone;
- cached: the same inputs asked again (the app's Plan page, a second `mixfleet plan`): the twin checks read back
  from the cache (`twin.checks.cached_map`);
- sequential (--sequential): `MIXFLEET_NO_CACHE=1` and one core (`taskset -c 0`), the checks one after another
  as before the change;
- page (--page, --page-only): the app's Plan page at its defaults, **Run planner** pressed (Streamlit's AppTest,
  in a fresh process and check cache each run): the seconds to the plan shown (the page's own `plan_timing`) and
  to the page complete: the planner, its checks and the page's twin points of the chosen mix and the
  seed's two fleets;
- beside (--beside REV): the cold mode of another commit (a clone of this repository at REV, installed in its own
  virtual environment on top of this Python's packages), its runs alternating with this tree's cold runs so that
  both see the same load; written with the commit and its chosen mix and twin figures.

Wall seconds depend on how busy the machine is: the 1-minute load average is written beside them.

    python benchmarks/planner_speed.py [--runs 3] [--sequential] [--page] [--beside ea5cd9e]
    python benchmarks/planner_speed.py --page-only [--runs 3]
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
import tomllib
from pathlib import Path

from beside import ROOT, build, head

OUT = Path(__file__).resolve().parent / "results" / "planner_speed.json"


def one(env: dict[str, str], prefix: list[str], exe: str = "mixfleet") -> tuple[float, dict]:
    w0 = time.perf_counter()
    p = subprocess.run([*prefix, exe, "plan", "--json"], env=env, capture_output=True, text=True, check=True)
    return time.perf_counter() - w0, json.loads(p.stdout)


PAGE = """
import json, sys, time
from streamlit.testing.v1 import AppTest
at = AppTest.from_file(sys.argv[1], default_timeout=1800)
at.run()
if len(sys.argv) > 2:
    at.number_input(key="pl_stale").set_value(float(sys.argv[2]))
    at.run()
w0 = time.perf_counter()
at.button(key="pl_go").click()
at.run()
wall = time.perf_counter() - w0
assert not at.exception and not at.error, [e.value for e in (*at.exception, *at.error)]
timing = dict(at.session_state["plan_timing"])
plan = at.session_state["planned_plan"].toml
print(json.dumps({"wall_s": wall, "plan_shown_s": timing["plan_shown_s"], "plan": plan}))
"""


def page(runs: int, *, new_question: float | None = None) -> dict:
    """The Plan page's Run planner at its defaults, each run on a fresh check cache and runs folder.
    new_question: the page asked once at its defaults first (not counted), then again with this max staleness
    (another chosen mix, so the planner's checks run again, while the seed fleets' twin points are read back)."""
    walls, shown, loads, mixes = [], [], [], []
    for _ in range(runs):
        tmp = Path(tempfile.mkdtemp(prefix="mixfleet-plan-page-"))
        try:
            env = {**os.environ, "MIXFLEET_CACHE_DIR": str(tmp / "cache"), "MIXFLEET_RUNS_DIR": str(tmp / "runs")}
            app = [sys.executable, "-c", PAGE, str(ROOT / "ui" / "app.py")]
            if new_question is not None:
                subprocess.run(app, env=env, capture_output=True, text=True, check=True)
                app.append(str(new_question))
            loads.append(os.getloadavg()[0])
            p = subprocess.run(app, env=env, capture_output=True, text=True, check=True)
            got = json.loads(p.stdout.strip().splitlines()[-1])
            walls.append(got["wall_s"])
            shown.append(got["plan_shown_s"])
            mixes.append({g["name"]: g["replicas"] for g in tomllib.loads(got["plan"])["groups"]})
            print(f"page{'' if new_question is None else ' (new question)'}: plan shown at {shown[-1]:.1f} s, "
                  f"page complete at {walls[-1]:.1f} s wall (load {loads[-1]:.1f})", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    what = ("Run planner pressed to the result shown (AppTest), the app's defaults, a fresh check cache"
            if new_question is None else
            f"Run planner pressed again with max staleness {new_question:g} after a first question at the "
            "defaults (another mix checked; the seed fleets' twin points read from the check cache)")
    return {"runs": walls, "median_wall_s": statistics.median(walls),
            # the page shows the plan first (Streamlit sends each element as it is drawn), then dry-runs the
            # seed's two fleets in the twin and adds their circles to the chart: seconds from the press to the plan
            # on the page (the page's own clock, `plan_timing`), beside the whole run to the page complete
            "plan_shown_s": shown, "median_plan_shown_s": statistics.median(shown),
            "load_avg_1m": loads, "best": mixes[-1], "what": what}


def summary(walls: list[float], loads: list[float], last: dict) -> dict:
    v = last.get("best", {}).get("verified", {})
    return {"runs": walls, "median_wall_s": statistics.median(walls), "load_avg_1m": loads,
            "checks": last.get("checks"), "best": last.get("best", {}).get("replicas"),
            "twin_time_per_update_s": v.get("time_per_update_s"),
            "twin_time_per_update_ci_s": v.get("time_per_update_ci_s"),
            "twin_cost_per_update_usd": v.get("cost_per_update_usd"),
            "twin_cost_per_update_ci_usd": v.get("cost_per_update_ci_usd")}


def beside(rev: str, runs: int) -> dict[str, dict]:
    """Cold runs of this tree and of `rev`, alternating (this tree first), each on a fresh check cache."""
    tmp = Path(tempfile.mkdtemp(prefix="mixfleet-plan-beside-"))
    try:
        exe = str(build(rev, tmp / "old") / "mixfleet")
        commit = subprocess.run(["git", "-C", str(tmp / "old"), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        got: dict[str, tuple[list[float], list[float], dict]] = {"cold": ([], [], {}), "old": ([], [], {})}
        for _ in range(runs):
            for name, exe_ in (("cold", "mixfleet"), ("old", exe)):
                cache = tmp / "cache"
                shutil.rmtree(cache, ignore_errors=True)
                walls, loads, _ = got[name]
                loads.append(os.getloadavg()[0])
                wall, last = one({**os.environ, "MIXFLEET_CACHE_DIR": str(cache)}, [], exe_)
                walls.append(wall)
                got[name] = (walls, loads, last)
                print(f"{name}: {wall:.1f} s wall (load {loads[-1]:.1f})", file=sys.stderr, flush=True)
        return {"cold": summary(*got["cold"]), "beside": {"commit": commit, **summary(*got["old"])}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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
    return summary(walls, loads, last)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sequential", action="store_true", help="also time one core without the cache")
    ap.add_argument("--page", action="store_true", help="also time the app's Plan page at its defaults")
    ap.add_argument("--beside", metavar="REV", help="also time this commit's cold plan, alternating with this tree's")
    ap.add_argument("--page-only", action="store_true", help="time only the Plan page; its entries replace those "
                    "of the results file (the other modes' are kept, with their commit)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if args.page_only:
        out = json.loads(args.out.read_text()) if args.out.exists() else {}
        out["page_commit"] = head()
        out["page"] = page(args.runs)
        out["page_new_question"] = page(args.runs, new_question=4.0)
        args.out.write_text(json.dumps(out, indent=2))
        print(json.dumps({k: out[k] for k in ("page_commit", "page", "page_new_question")}, indent=2))
        print(f"wrote {args.out}")
        return
    out: dict = {"command": "mixfleet plan --json (defaults)", "commit": head()}
    out.update(beside(args.beside, args.runs) if args.beside else {"cold": mode("cold", args.runs, fresh_cache=True)})
    out["cached"] = mode("cached", args.runs, fresh_cache=False)
    if args.page:
        out["page"] = page(args.runs)
        out["page_new_question"] = page(args.runs, new_question=4.0)
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
