"""The planner's analytic screen against the twin's steady state, on random feasible mixes and the seed fleets.

Per mix: the analytic time per update, cost per update and staleness (`planner.fleet.metrics`) next to the
twin's steady-state means with their 95% batch-means intervals (`simulate`, then costmodel's steady-state
analysis: pipeline fill and MSER-5 warm-up left out), and the relative error (analytic - twin) / twin.
Mixes: `--mixes` random ones (seeded) from the default pool's group types: 1-4 types, 1-16 replicas each,
prompts in flight K = 1..8 x prompts per update, kept when they meet the default GPU caps and are not
trainer-bound (staleness unbounded: no steady state); plus data/plans/seed-mixed.toml and seed-homogeneous.toml.
Each twin run is 12 + 3 K / B updates (the warm-up lasts about one prompt-group lifetime, K / B updates).
Prints a table and writes benchmarks/results/planner_vs_twin.json (rows, median and worst errors).

    python benchmarks/planner_vs_twin.py [--mixes 20] [--seed 0] [--resume]

--resume keeps the twin's runs already in --out (same mix, K and updates) and recomputes the analytic side,
so a change to the screen is re-scored without re-running the twin.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from mixfleet.costmodel.jsonsafe import json_safe
from mixfleet.costmodel.specs.workload import load_workload
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import group_types, metrics
from mixfleet.planner.search import K_FACTORS, _candidate, candidate_plan, evaluate_plan
from mixfleet.policies.plan import load_plan
from mixfleet.twin.sim import simulate

OUT = Path(__file__).resolve().parent / "results" / "planner_vs_twin.json"
METRICS = (("time_per_update_s", "steady_time_per_update_s", "steady_time_per_update_ci_s"),
           ("cost_per_update_usd", "steady_cost_per_update_usd", "steady_cost_per_update_ci_usd"),
           ("staleness", "steady_staleness_mean", "steady_staleness_ci"))


def random_mixes(cfg: PlannerConfig, count: int, seed: int) -> tuple[list, list]:
    types = group_types(cfg)
    wl = load_workload(cfg.workload)
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < count:
        n = np.zeros(len(types), dtype=int)
        for j in rng.choice(len(types), size=int(rng.integers(1, 5)), replace=False):
            n[j] = int(rng.integers(1, 17))
        gpus: dict[str, int] = {}
        for t, c in zip(types, n, strict=True):
            gpus[t.accelerator] = gpus.get(t.accelerator, 0) + c * t.tp
        if any(g > cfg.max_gpus.get(a, cfg.default_max_gpus) for a, g in gpus.items()):
            continue
        k = int(rng.choice(K_FACTORS)) * wl.prompts_per_update
        m = metrics(types, n[None, :], np.array([k]), cfg)
        if bool(m["trainer_bound"][0]):
            continue
        out.append(_candidate(types, n, k, m, 0))
    return types, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mixes", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--resume", action="store_true", help="keep the rows already in --out (same mixes), run the rest")
    ap.add_argument("--rows-from", type=Path, nargs="*", default=[],
                    help="also keep the finished rows of these files (e.g. shards' outputs)")
    ap.add_argument("--shard", default="0/1", help="I/N: run only mixes i with i %% N == I (parallel shards)")
    ap.add_argument("--summarize-only", action="store_true",
                    help="run nothing: the table and errors of the rows kept (--resume / --rows-from), marked partial "
                         "when mixes are missing")
    args = ap.parse_args()
    shard, shards = (int(x) for x in args.shard.split("/"))
    cfg = PlannerConfig()
    wl = load_workload(cfg.workload)
    types, cands = random_mixes(cfg, args.mixes, args.seed)
    jobs = [(f"random-{i:02d}", candidate_plan(c, types, cfg, name=f"random-{i:02d}"), c)
            for i, c in enumerate(cands)]
    for name in ("seed-mixed", "seed-homogeneous"):
        plan = load_plan(name)
        jobs.append((name, plan, evaluate_plan(plan)))
    rows = []
    done = {}
    for f in ([args.out] if args.resume and args.out.exists() else []) + list(args.rows_from):
        done.update({r["mix"]: r for r in json.loads(f.read_text()).get("rows", [])})
    for j, (name, plan, est) in enumerate(jobs):
        kb = est.inflight_prompts / wl.prompts_per_update
        updates = int(12 + 3 * kb)
        old = done.get(name)
        if old is not None and old["replicas"] == est.replicas and old["inflight_prompts"] == est.inflight_prompts \
                and old["updates"] == updates:   # the twin's run is kept; the analytic side is recomputed
            twin = {a_key: (old[a_key]["twin"], old[a_key]["twin_ci"]) for a_key, _, _ in METRICS}
            row = {k: old[k] for k in ("mix", "replicas", "inflight_prompts", "updates", "warmup_updates", "cpu_s")}
        elif j % shards != shard or args.summarize_only:
            continue
        else:
            t0 = time.process_time()
            s = simulate(plan, updates=updates, seed=args.seed).summary
            twin = {a_key: (float(getattr(s, t_key)), float(getattr(s, ci_key))) for a_key, t_key, ci_key in METRICS}
            row = {"mix": name, "replicas": est.replicas, "inflight_prompts": est.inflight_prompts,
                   "updates": updates, "warmup_updates": s.warmup_updates, "cpu_s": time.process_time() - t0}
        for a_key, _, _ in METRICS:
            a, (t, ci) = float(getattr(est, a_key)), twin[a_key]
            row[a_key] = {"analytic": a, "twin": t, "twin_ci": ci, "rel_error": (a - t) / t,
                          "analytic_inside_ci": bool(abs(a - t) <= ci)}
        rows.append(row)
        print(f"{name:17s} K/B {kb:.0f} {updates:3d} upd (warm-up {row['warmup_updates']:2d}) "
              + "  ".join(f"{k[:4]} {row[k]['analytic']:8.2f} vs {row[k]['twin']:8.2f} ± {row[k]['twin_ci']:6.2f} "
                          f"({row[k]['rel_error']:+.1%})" for k, _, _ in METRICS), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(json_safe({"rows": rows, "partial": True}), indent=2))  # resumable
    summary = {}
    for a_key, _, _ in METRICS:
        err = np.array([abs(r[a_key]["rel_error"]) for r in rows])
        worst = int(np.argmax(err))
        summary[a_key] = {"median_abs_rel_error": float(np.median(err)), "worst_abs_rel_error": float(err[worst]),
                          "worst_mix": rows[worst]["mix"], "within_10pct": int((err <= 0.10).sum()),
                          "mixes": len(rows)}
        print(f"{a_key:22s} median |error| {np.median(err):.1%}, worst {err[worst]:.1%} ({rows[worst]['mix']}), "
              f"{(err <= 0.10).sum()}/{len(rows)} within 10%")
    out = {"rows": rows, "summary": summary, "partial": len(rows) < len(jobs), "mixes_planned": len(jobs),
           "cpu_s_twin_runs": float(sum(r["cpu_s"] for r in rows)), "seed": args.seed,
           "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(json_safe(out), indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
