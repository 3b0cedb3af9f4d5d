"""The README tour's two real runs, read back: held-out reward at T = 1 before and after, per run.

The tour runs are started by hand (they take minutes each on this CPU), exactly as the README writes them, seeds
1 and 2 through a plan that sets only `seed` over the shipped plan:

    mixfleet run data/plans/tiny-cpu.toml --out runs/tiny --updates 30
    printf 'base = "tiny-cpu"\\nseed = 1\\n' > tiny-cpu-s1.toml
    mixfleet run tiny-cpu-s1.toml --out runs/tiny-s1 --updates 30
    ...

This script only reads their run logs (the runner's `eval` events: the held-out split at T = 1 with
the plan's own eval settings) and writes benchmarks/results/tour_learning.json, the file the README's tour figures
cite:

    python benchmarks/tour_learning.py --run tiny-cpu:runs/tiny,runs/tiny-s1,runs/tiny-s2 \\
        --run tiny-moe-cpu:runs/moe30-s0,runs/moe30-s1,runs/moe30-s2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "tour_learning.json"


def read_tour_run(folder: Path) -> dict[str, Any]:
    """First and last held-out evaluation of one run log; a clear error if the run has no evaluations."""
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.costmodel.records.trackers import eval_frame

    if (why := RunLog.not_a_run_log(folder)) is not None:
        raise SystemExit(f"{folder}: not a run log ({why}); start the run first")
    log = RunLog.open(folder)
    ev = eval_frame(log.events).sort_values("version")
    if len(ev) < 2:
        raise SystemExit(f"{folder}: {len(ev)} held-out evaluation(s); the tour needs the one at the start and one "
                         f"after training")
    first, last = ev.iloc[0], ev.iloc[-1]
    plan = log.header.get("plan") or {}
    return {"run": str(folder), "plan": plan.get("name"),
            "seed": plan.get("seed", log.header.get("seed")), "status": log.header.get("status"),
            "updates": int(len(log.updates)),
            "problems": int(last.problems),
            "reward_start": float(first.reward), "version_start": int(first.version),
            "reward_end": float(last.reward), "version_end": int(last.version),
            "gain": float(last.reward - first.reward),
            "curve": [[int(r.version), float(r.reward)] for r in ev.itertuples()]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="LABEL:DIR[,DIR...]",
                    help="a tour line's label and its run folders (one per seed)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    out: dict[str, Any] = {"what": "README tour: held-out reward at T = 1 at the first and last evaluation",
                           "lines": {}}
    for spec in args.run:
        label, _, dirs = spec.partition(":")
        if not dirs:
            ap.error(f"--run {spec!r}: expected LABEL:DIR[,DIR...]")
        runs = [read_tour_run(Path(d)) for d in dirs.split(",")]
        gains = [r["gain"] for r in runs]
        out["lines"][label] = {"runs": runs, "mean_gain": statistics.fmean(gains), "min_gain": min(gains),
                               "max_gain": max(gains), "seeds": len(runs)}
        print(f"{label}: " + ", ".join(f"{r['reward_start']:.3f}->{r['reward_end']:.3f}" for r in runs)
              + f"  mean gain {statistics.fmean(gains):+.3f} (min {min(gains):+.3f}, max {max(gains):+.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
