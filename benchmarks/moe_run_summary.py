"""Summarize a real `mixfleet run` of a MoE plan (tiny-moe-cpu): reward curve, per-group routing disagreement.

    python benchmarks/moe_run_summary.py RUN_DIR [RUN_DIR ...] [--out benchmarks/results/tiny_moe_cpu_run.json]

Reads each run log (costmodel/records/runlog.py) and writes one JSON with, per run: the plan, the trainer's routing
mode, updates, wall time per update, the mean reward per update and by sampling version, KL k3 per update,
and per group (from the `groups` table) the routing disagreement per update and its token-weighted mean:
`routing_token_share` (share of the group's trained tokens whose top-k expert set in the sampler differs
from the trainer's in >= 1 layer) and `routing_layer_share` (mean share of the layers that differ), plus
the group's KL k3. Nothing is computed here that the run did not log; a run still going is summarized as
far as it got (its header's status says so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from mixfleet.costmodel.jsonsafe import json_safe
from mixfleet.costmodel.records.runlog import RunLog


def _wmean(values: Any, weights: Any) -> float:
    v, w = np.asarray(values, dtype=float), np.asarray(weights, dtype=float)
    ok = np.isfinite(v) & (w > 0)
    return float((v[ok] * w[ok]).sum() / w[ok].sum()) if ok.any() else math.nan


def summarize_run(path: Path) -> dict[str, Any]:
    log = RunLog.open(path)
    h, u, g, tr = log.header, log.updates.sort_values("version"), log.groups, log.trajectories
    plan = h.get("plan") or {}
    out: dict[str, Any] = {
        "run_dir": str(path), "plan": plan.get("name"), "model": plan.get("model"),
        "trainer_routing": (plan.get("trainer") or {}).get("routing", "free"), "status": h.get("status"),
        "updates": int(len(u)),
        "wall_s_update_loop": float(u["end_s"].max() - u["start_s"].min()) if len(u) else math.nan,
        "time_per_update_mean_s": float((u["end_s"] - u["start_s"]).mean()) if len(u) else math.nan,
        "reward_mean_per_update": [float(x) for x in u["reward_mean"]],
        "kl_k3_per_update": [float(x) for x in u["kl_k3"]],
        "staleness_mean": _wmean(u["staleness_mean"], u["tokens"]),
    }
    if len(tr):
        done = tr[tr["trained_version"] >= 0] if "trained_version" in tr else tr
        out["reward_by_sampling_version"] = {str(int(k)): float(v) for k, v in
                                             done.groupby("version_start")["reward"].mean().items()}
    rewards = out["reward_mean_per_update"]
    if len(rewards) >= 10:
        out["reward_first5_mean"] = float(np.mean(rewards[:5]))
        out["reward_last5_mean"] = float(np.mean(rewards[-5:]))
    groups: dict[str, Any] = {}
    for name, rows in g.groupby("group", sort=True):
        rows = rows.sort_values("version")
        w = rows["tokens_trained"]
        groups[str(name)] = {
            "routing_token_share_per_update": [float(x) for x in rows["routing_token_share"]],
            "routing_layer_share_per_update": [float(x) for x in rows["routing_layer_share"]],
            "routing_token_share_mean": _wmean(rows["routing_token_share"], w),
            "routing_layer_share_mean": _wmean(rows["routing_layer_share"], w),
            "kl_k3_mean": _wmean(rows["kl_k3"], w),
            "tokens_trained": int(w.sum()),
            "share_of_samples_mean": float(rows["share_of_samples"].mean()),
        }
    out["groups"] = groups
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "tiny_moe_cpu_run.json")
    ap.add_argument("--note", default="", help="machine / load note stored with the numbers")
    args = ap.parse_args()
    result = {"what": "benchmarks/moe_run_summary.py over real `mixfleet run` logs", "note": args.note,
              "load_average": list(os.getloadavg()), "runs": [summarize_run(p) for p in args.runs]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(json_safe(result), indent=2) + "\n")
    for r in result["runs"]:
        curve = " ".join(f"{x:.3f}" for x in r["reward_mean_per_update"])
        print(f"{r['plan']} (routing {r['trainer_routing']}, {r['status']}): {r['updates']} updates, "
              f"{r['time_per_update_mean_s']:.1f} s/update; reward per update {curve}")
        for name, gr in r["groups"].items():
            print(f"  {name:10s} routing differs: tokens {gr['routing_token_share_mean']:.3f}, layers "
                  f"{gr['routing_layer_share_mean']:.3f}; KL k3 {gr['kl_k3_mean']:.2e}; {gr['tokens_trained']} tokens")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
