"""Where a CPU sampler's time goes in a real run: per replica, its concurrency, decode pace and CPU use.

Why (issue 42 item 4): the calibrated twin mispredicts a repo plan whose samplers run at other batch sizes than
the run it was calibrated on. This reads real run logs (the runner's header keeps each process's CPU seconds,
`cpu_s`) and gives per sampler replica: episodes, generated tokens, busy seconds (some episode open on it), the
mean number of open episodes while busy (`n_busy`, waits for a sandbox included), wall seconds per decode step
(open-episode-seconds / tokens: each open, decoding episode gets one token per step), CPU seconds per generated
token and the share of a core the process got while busy; the trainer's the same way (its busy time = its steps).

    python benchmarks/sampler_cpu_use.py RUN [RUN ...] [--out benchmarks/results/sampler_cpu_use.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results" / "sampler_cpu_use.json"


def replica_use(start: np.ndarray, end: np.ndarray, tokens: float, cpu_s: float) -> dict[str, float]:
    """One replica's figures from its episodes' spans, generated tokens and its process's CPU seconds."""
    t = np.unique(np.concatenate([start, end]))
    if len(t) < 2 or tokens <= 0:
        return {}
    mid = (t[:-1] + t[1:]) / 2.0
    n = ((start[None, :] <= mid[:, None]) & (end[None, :] > mid[:, None])).sum(axis=1)
    w = np.diff(t)
    busy = n > 0
    busy_s = float(w[busy].sum())
    open_s = float((n * w).sum())
    return {"busy_s": busy_s, "n_busy": open_s / busy_s, "wall_s_per_step": open_s / tokens,
            "cpu_s": cpu_s, "cpu_s_per_token": cpu_s / tokens, "core_share_busy": cpu_s / busy_s}


def run_use(run: Path) -> dict[str, Any]:
    from mixfleet.costmodel.records.runlog import RunLog

    log = RunLog.open(run)
    h = log.header
    cpu = h.get("cpu_s") or {}
    tr = log.trajectories
    out: dict[str, Any] = {"run": str(run), "plan": h.get("plan", {}).get("name"), "loop_s": h.get("loop_s"),
                           "cpu_s": cpu, "cores_used_over_loop": sum(cpu.values()) / h["loop_s"]
                           if h.get("loop_s") else None, "replicas": {}}
    for (g, r), d in tr.groupby(["group", "replica"]):
        tok = float(d["generated_tokens"].sum())
        use = replica_use(d["start_s"].to_numpy(float), d["end_s"].to_numpy(float), tok,
                          float(cpu.get(f"{g}#{r}", np.nan)))
        out["replicas"][f"{g}#{r}"] = {"episodes": len(d), "tokens": tok, **use}
    up = log.updates
    steps = float(up["train_step_s"].sum())
    out["trainer"] = {"steps": len(up), "step_s_mean": float(up["train_step_s"].mean()), "busy_s": steps,
                      "cpu_s": cpu.get("trainer"), "core_share_busy": (cpu.get("trainer") or np.nan) / steps}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    res = {"benchmark": "sampler_cpu_use", "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "runs": [run_use(r) for r in args.runs]}
    for r in res["runs"]:
        print(f"{r['run']} ({r['plan']}): loop {r['loop_s']:.0f} s, {r['cores_used_over_loop']:.2f} cores used; "
              f"trainer step {r['trainer']['step_s_mean']:.2f} s at {r['trainer']['core_share_busy']:.2f} core")
        for name, u in r["replicas"].items():
            print(f"  {name:>12}: {u['episodes']:>4} episodes, n_busy {u['n_busy']:5.2f}, "
                  f"{1e3 * u['wall_s_per_step']:5.1f} ms/step, {1e3 * u['cpu_s_per_token']:5.2f} CPU-ms/token, "
                  f"{u['core_share_busy']:.2f} core while busy")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
