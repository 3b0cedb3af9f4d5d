"""How fast the run log takes a seed-scale run: build, write, read and summarize 200 updates x 1,024
trajectories (plus updates / groups rows). Prints the numbers and writes them as JSON.

    python benchmarks/runlog_speed.py [--updates 200] [--out benchmarks/results/runlog_speed.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from mixfleet.costmodel.records.runlog import GroupRecord, RunLog, RunLogWriter, TrajectoryRecord, UpdateRecord
from mixfleet.costmodel.records.runsummary import summarize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=200)
    ap.add_argument("--per-update", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "runlog_speed.json")
    args = ap.parse_args()
    n_traj = args.updates * args.per_update
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "run"
        t0 = time.perf_counter()
        w = RunLogWriter(d, {"source": "twin"}, flush_every_rows=20_000, flush_every_s=None)
        for v in range(1, args.updates + 1):
            for i in range(args.per_update):
                w.append(TrajectoryRecord(
                    run_id="bench", prompt_id=i // 8, sample_index=i % 8, group=f"g{i % 8}", replica=i % 4,
                    version_start=v - 1, version_end=v - 1, turns=40, prompt_tokens=30_000, generated_tokens=8_000,
                    start_s=10.0 * v, end_s=10.0 * v + 5, reward=1.0, finish_reason="done"))
            w.append(UpdateRecord(version=v, start_s=10.0 * v, end_s=10.0 * v + 9, train_step_s=5.0, weight_sync_s=1.0,
                                  tokens=8_000 * args.per_update, trajectories=args.per_update, staleness_mean=1.0,
                                  staleness_p50=1.0, staleness_p95=2.0, staleness_max=3.0,
                                  cost_sampler_usd=10.0 * v, cost_trainer_usd=2.0 * v))
            for g in range(8):
                w.append(GroupRecord(version=v, group=f"g{g}", replicas_up=2.0, utilization=0.8,
                                     tokens_generated=1_000_000, samples=args.per_update // 8, share_of_samples=0.125))
        w.close()
        t1 = time.perf_counter()
        log = RunLog.open(d)
        t2 = time.perf_counter()
        summarize(log)
        t3 = time.perf_counter()
        size_bytes = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
    out = {"updates": args.updates, "trajectories": n_traj, "append_and_write_s": round(t1 - t0, 3),
           "us_per_trajectory_written": round((t1 - t0) / n_traj * 1e6, 2), "read_s": round(t2 - t1, 3),
           "summarize_s": round(t3 - t2, 4), "size_bytes": size_bytes}
    print(json.dumps(out, indent=2))
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
