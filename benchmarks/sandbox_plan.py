"""What an update costs with its sandboxes, and what binds, at two sandbox caps (issue 42).

Plans the seed's workload (data/workloads/seed-agentic-coding.toml, the seed's model, the default pool and
trainer: `mixfleet plan`'s defaults) with sandboxes on: one per episode, 10 s to start (the default, an
estimate), the catalog's sandbox price (data/accelerators.toml [sandbox]: E2B's per-second rates at 2 vCPU +
4 GiB, $0.1656 per sandbox-hour). Once with a cap that does not bind (--cap-loose, default 4096) and once with
one that does (--cap-tight, default 512). Per cap: the chosen mix, cost per update split into sampling, training
and sandboxes (the analytic screen, and the twin's steady state for the chosen plan: `--verify` candidates), the
pool-wait share, the sandboxes live on average, and what binds. The same as

    mixfleet plan --sandbox-cap 4096 --verify 1
    mixfleet plan --sandbox-cap 512 --verify 1

Prints a table and writes benchmarks/results/sandbox_plan.json.

    python benchmarks/sandbox_plan.py [--cap-loose 4096] [--cap-tight 512] [--verify 1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from mixfleet.costmodel.jsonsafe import json_safe
from mixfleet.costmodel.plan.planspec import resolve_sandbox
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.search import binds_text, plan_mix, sequential_map
from mixfleet.twin.checks import twin_check

OUT = Path(__file__).resolve().parent / "results" / "sandbox_plan.json"


def plan_at(cap: int, verify: int) -> dict[str, Any]:
    cfg = PlannerConfig(sandbox_cap=cap, verify=verify)
    t0 = time.perf_counter()
    r = plan_mix(cfg, check=twin_check, check_map=sequential_map)
    wall = time.perf_counter() - t0
    b = r.best
    sb = resolve_sandbox(r.plan.sandbox)
    row: dict[str, Any] = {
        "command": f"mixfleet plan --sandbox-cap {cap} --verify {verify}", "cap": cap,
        "mix": b.replicas, "inflight_prompts": b.inflight_prompts,
        "analytic": {"time_per_update_s": b.time_per_update_s, "cost_per_update_usd": b.cost_per_update_usd,
                     "sampling_usd": b.cost_sampling_per_update_usd, "training_usd": b.cost_training_per_update_usd,
                     "sandbox_usd": b.cost_sandbox_per_update_usd, "sandbox_wait_share": b.sandbox_wait_share,
                     "sandboxes_live": b.sandboxes_live, "staleness": b.staleness},
        "cap_binds": b.sandbox_wait_share > 0,
        "binds": [{"flag": x.flag, "limit": x.limit, "relaxed_objective": x.relaxed_objective, "gain": x.gain,
                   "relaxed_value": x.relaxed_value, "text": x.text()} for x in r.binds],
        "binds_text": binds_text(r.binds),
        "sandbox": {"max_live": sb.max_live, "start_s": sb.start_s, "usd_per_hour": sb.usd_per_hour,
                    "price_source": sb.price_source},
        "screened": r.screened, "wall_s": wall,
    }
    if b.verified:
        v = b.verified
        row["twin"] = {"updates": v["updates"], "steady_updates": v["steady_updates"],
                       "time_per_update_s": v["time_per_update_s"], "time_per_update_ci_s": v["time_per_update_ci_s"],
                       "cost_per_update_usd": v["cost_per_update_usd"],
                       "cost_per_update_ci_usd": v["cost_per_update_ci_usd"],
                       "sampling_usd": v["cost_sampler_per_update_usd"],
                       "sandbox_usd": v["cost_sandbox_per_update_usd"],
                       "sandbox_ci_usd": v["cost_sandbox_per_update_ci_usd"],
                       "training_usd": v["cost_per_update_usd"] - v["cost_sampler_per_update_usd"]
                       - v["cost_sandbox_per_update_usd"],
                       "sandbox_wait_share": v["sandbox_wait_share"], "staleness": v["staleness"],
                       # Little's law on the twin's figures: sandbox-seconds per update / time per update
                       "sandboxes_live": v["cost_sandbox_per_update_usd"] * 3600.0 / sb.usd_per_hour
                       / v["time_per_update_s"]}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cap-loose", type=int, default=4096)
    ap.add_argument("--cap-tight", type=int, default=512)
    ap.add_argument("--verify", type=int, default=1, help="candidates verified in the twin (0: analytic only)")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    rows = [plan_at(cap, a.verify) for cap in (a.cap_loose, a.cap_tight)]
    hdr = (f"{'cap':>6} {'binds':>5} {'K':>5} {'t/update s':>10} {'USD/update':>10} {'sampling':>9} {'training':>9} "
           f"{'sandbox':>8} {'wait':>6} {'live':>6}")
    for side in ("analytic", "twin"):
        print(f"{side} (cost per update split, USD; wait: pool-wait share; live: sandboxes live on average)")
        print(hdr)
        for r in rows:
            x = r.get(side)
            if x is None:
                continue
            print(f"{r['cap']:>6} {'yes' if r['cap_binds'] else 'no':>5} {r['inflight_prompts']:>5} "
                  f"{x['time_per_update_s']:>10,.0f} {x['cost_per_update_usd']:>10,.2f} {x['sampling_usd']:>9,.2f} "
                  f"{x['training_usd']:>9,.2f} {x['sandbox_usd']:>8,.2f} {x['sandbox_wait_share']:>6.1%} "
                  f"{x['sandboxes_live']:>6,.0f}")
    for r in rows:
        print(f"cap {r['cap']}: mix {', '.join(f'{g} x{n}' for g, n in r['mix'].items())}; what binds: "
              f"{r['binds_text']}")
    print(f"sandbox price: ${rows[0]['sandbox']['usd_per_hour']:.4g} per sandbox-hour "
          f"({rows[0]['sandbox']['price_source']})")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(json_safe({
        "workload": "seed-agentic-coding", "model": PlannerConfig().model,
        "sandbox_start_s": rows[0]["sandbox"]["start_s"],
        "note": "analytic: the planner's screen for the chosen mix; twin: the chosen plan's steady state in the twin "
                "(warm start, pipeline fill and MSER-5 warm-up left out, 95% batch-means half-widths); training in "
                "the twin = total - sampling - sandboxes; start latency 10 s and the sandbox size are estimates",
        "caps": rows}), indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
