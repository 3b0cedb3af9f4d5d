"""The twin as the re-planner's test bench (issue 27 item 2): static vs re-planned vs oracle on a perturbed truth.

At the seed's scale (data/plans/seed-mixed.toml: 8 groups, 128 prompts x 8 samples per update, 512 in flight),
each group free to move within [1, 40] replicas. Three plans, the same seeds, the same truth world
(`simulate(plan, truth=...)`, `twin.replan.perturbed_truth`):

- static: the counts the planner's model picks from the priors (`planner.solver.planner_solver` with no fit), kept;
- re-planned: the same start with the `replan` autoscaler (defaults, the bench's objective and staleness bound);
- oracle: the counts the same model picks with the truth from the start, kept.

Cost per update (and per effective update) over the updates after the re-planned run's first adopted re-plan
(the same updates for all three), and the staleness: token-weighted mean over those updates and the largest
per-update mean of the whole run, against the bound.

    nice -n 15 python benchmarks/replan_bench.py [--seeds 5] [--updates 30] [--only slow40]

Writes benchmarks/results/replan_bench.json.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.planner.solver import planner_solver
from mixfleet.policies.plan import Plan, load_plan, with_overrides
from mixfleet.policies.registry import make_config
from mixfleet.twin.replan import perturbed_truth
from mixfleet.twin.sim import simulate

OUT = Path(__file__).resolve().parent / "results" / "replan_bench.json"
MAX_REPLICAS = 40
MAX_STALENESS = 4.0                  # versions: the bound the re-planner and both sizings keep
PERTURBATIONS: dict[str, dict[str, Any]] = {
    "slow40": {"what": "B200-NVFP4 40% slower than its prior (speed x 0.6)", "slower": {"B200-NVFP4": 0.6},
               "objective": "cost_per_update"},
    "slow20": {"what": "B200-NVFP4 20% slower than its prior (speed x 0.8)", "slower": {"B200-NVFP4": 0.8},
               "objective": "cost_per_update"},
    "mismatch2": {"what": "B200-NVFP4 twice as mismatched (KL and extreme share x 2)",
                  "mismatch": {"B200-NVFP4": 2.0}, "objective": "cost_per_effective_update"},
}


def pool_plan() -> Plan:
    plan = load_plan("seed-mixed")
    over: dict[str, Any] = {}
    for g in plan.groups:
        over[f"groups.{g.name}.min_replicas"] = 1
        over[f"groups.{g.name}.max_replicas"] = MAX_REPLICAS
    return with_overrides(plan, over)


def with_counts(plan: Plan, counts: dict[str, int], autoscaler: dict[str, Any] | None = None) -> Plan:
    over: dict[str, Any] = {f"groups.{g}.replicas": n for g, n in counts.items()}
    for k, v in (autoscaler or {}).items():
        over[f"policies.autoscaler.{k}"] = v
    return with_overrides(plan, over)


def measure(log_dir: Path, first_v: int | None) -> dict[str, Any]:
    log = RunLog.open(log_dir)
    up = log.updates.sort_values("version").reset_index(drop=True)
    cost = (up["cost_sampler_usd"] + up["cost_trainer_usd"]).to_numpy()
    v = up["version"].to_numpy()
    i0 = 0 if first_v is None else int(np.searchsorted(v, first_v))
    after = slice(i0, len(up))
    n_after = len(up) - i0 - 1
    cpu_after = (cost[-1] - cost[i0]) / n_after if n_after > 0 else math.nan
    tok = up["tokens"].to_numpy(dtype=float)
    ext = up["extreme_share"].to_numpy(dtype=float)
    ext_after = float(np.nansum(ext[after][1:] * tok[after][1:]) / tok[after][1:].sum()) if n_after > 0 else math.nan
    st = up["staleness_mean"].to_numpy(dtype=float)
    ev = log.events
    rp = ev[ev["kind"] == "replan"]
    decisions = [{"version": int(r.version), **json.loads(r.detail)} for r in rp.itertuples()]
    mix = {str(g): [round(float(x), 2) for x in gr.sort_values("version")["replicas_up"]]
           for g, gr in log.groups.groupby("group")}
    return {"updates": len(up), "cost_per_update_all": float(cost[-1] / len(up)),
            "cost_per_update_after": float(cpu_after),
            "cost_per_effective_update_after": float(cpu_after / (1 - ext_after)) if n_after > 0 else math.nan,
            "staleness_after": float(np.sum(st[after][1:] * tok[after][1:]) / tok[after][1:].sum())
            if n_after > 0 else math.nan,
            "staleness_max_update": float(np.nanmax(st)), "time_per_update_after_s":
            float((up["end_s"].iloc[-1] - up["end_s"].iloc[i0]) / n_after) if n_after > 0 else math.nan,
            "decisions": decisions, "mix_replicas_by_update": mix}


def table(results: dict[str, Any]) -> str:
    """The results as docs/twin.md shows them: per perturbation and plan, means over the seeds done (updates after
    the re-planned run's first adopted re-plan), the re-planned run's gap to the oracle, the staleness bound."""
    out = ["| truth | plan | seeds | counts | USD / update after 1st re-plan | USD / effective update | staleness "
           "(mean after / max update) |", "|---|---|---|---|---|---|---|"]
    for p in results["perturbations"].values():
        for kind in ("static", "replanned", "oracle"):
            m = p["summary"][kind]
            counts = {"static": p["prior_counts"], "oracle": p["oracle_counts"]}.get(kind)
            mix = ", ".join(f"{g} {n}" for g, n in counts.items() if n > 1) if counts else "re-planned"
            out.append(f"| {p['what'] if kind == 'static' else ''} | {kind} | {p['seeds_done']} | {mix} | "
                       f"{m['cost_per_update_after']:.2f} | {m['cost_per_effective_update_after']:.2f} | "
                       f"{m['staleness_after']:.2f} / {m['staleness_max_update']:.2f} |")
        g = p["replanned_vs_oracle"]
        out.append(f"| | re-planned vs oracle | | | {g['mean']:+.1%} mean, {g['max']:+.1%} worst seed | | bound "
                   f"{results['max_staleness']:g} {'kept' if p['staleness_bound_kept'] else 'BROKEN'} |")
    return "\n".join(out)


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    xs = [r[key] for r in rows if math.isfinite(r[key])]
    return float(np.mean(xs)) if xs else math.nan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--only", default="", help="comma-separated perturbations: " + ", ".join(PERTURBATIONS))
    ap.add_argument("--work", default="/tmp/mixfleet-replan-bench")
    ap.add_argument("--table", action="store_true", help="print the Markdown table of the results file and stop")
    args = ap.parse_args()
    if args.table:
        print(table(json.loads(OUT.read_text())))
        return
    names = [n for n in (args.only.split(",") if args.only else PERTURBATIONS)]
    pool = pool_plan()
    start = {g.name: g.replicas for g in pool.groups}
    touch = tuple(start)
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    results.setdefault("perturbations", {})
    results.update({"plan": "seed-mixed", "max_replicas": MAX_REPLICAS, "max_staleness": MAX_STALENESS,
                    "updates": args.updates, "seeds": args.seeds, "warm_start": True,
                    "command": "nice -n 15 python benchmarks/replan_bench.py --seeds "
                               f"{args.seeds} --updates {args.updates}"})
    setups = {}
    for name in names:
        spec = PERTURBATIONS[name]
        settings = {"name": "replan", "objective": spec["objective"], "max_staleness": MAX_STALENESS}
        cfg = make_config("autoscaler", "replan", {k: v for k, v in settings.items() if k != "name"})
        prior = planner_solver(pool, cfg, None)(None, start, touch, {})
        truth = perturbed_truth(pool, slower=spec.get("slower"), mismatch=spec.get("mismatch"))
        oracle = planner_solver(pool, cfg, truth)(None, prior.counts, touch, {})
        plans = {"static": with_counts(pool, prior.counts),
                 "replanned": with_counts(pool, prior.counts, settings),
                 "oracle": with_counts(pool, oracle.counts)}
        setups[name] = (spec, prior, oracle, truth, plans, {k: [] for k in plans})
    for seed in range(args.seeds):          # seeds outermost: whatever has finished is written
        for name, (spec, prior, oracle, truth, plans, rows) in setups.items():
            runs = {}
            for kind, plan in plans.items():
                d = Path(args.work) / name / f"{kind}-{seed}"
                if d.exists():
                    shutil.rmtree(d)
                t0 = time.perf_counter()
                simulate(plan, updates=args.updates, seed=seed, truth=truth, out=d, warm_start=True)
                runs[kind] = (d, time.perf_counter() - t0)
            re = measure(runs["replanned"][0], None)
            adopted = [x for x in re["decisions"] if x["adopted"]]
            first_v = adopted[0]["version"] if adopted else None
            for kind, (d, wall) in runs.items():
                m = measure(d, first_v)
                m.update(seed=seed, wall_s=round(wall, 1), first_replan_version=first_v)
                if kind != "replanned":
                    m.pop("decisions")
                rows[kind].append(m)
            print(name, seed, {k: round(rows[k][-1]["cost_per_update_after"], 2) for k in rows}, "first re-plan",
                  first_v, flush=True)
            results["perturbations"][name] = report(spec, prior.counts, oracle.counts, rows)
            OUT.parent.mkdir(parents=True, exist_ok=True)
            OUT.write_text(json.dumps(results, indent=1, default=lambda x: None))


def report(spec: dict[str, Any], prior: dict[str, int], oracle: dict[str, int],
           rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The seeds done so far: means per plan, the re-planned run's gap to the oracle, the staleness bound."""
    summary = {k: {key: _mean(rows[k], key) for key in ("cost_per_update_all", "cost_per_update_after",
                                                         "cost_per_effective_update_after", "staleness_after",
                                                         "staleness_max_update", "time_per_update_after_s")}
               for k in rows}
    key = "cost_per_update_after" if spec["objective"] == "cost_per_update" else "cost_per_effective_update_after"
    gaps = [r[key] / o[key] - 1 for r, o in zip(rows["replanned"], rows["oracle"], strict=True)]
    return {"what": spec["what"], "objective": spec["objective"], "prior_counts": prior, "oracle_counts": oracle,
            "seeds_done": len(rows["static"]), "summary": summary,
            "replanned_vs_oracle": {"mean": float(np.mean(gaps)), "max": float(np.max(gaps)), "per_seed": gaps},
            "staleness_bound_kept": bool(max(r["staleness_max_update"] for r in rows["replanned"]) <= MAX_STALENESS),
            "runs": rows}

if __name__ == "__main__":
    main()
