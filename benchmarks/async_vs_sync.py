"""Fully asynchronous vs synchronous RL on the same plan: wall time and trainer-idle share.

Why: the seed's claim is that samplers that never wait for the trainer (and a trainer that never waits
for the slowest episode) make each update cheaper. This runs one plan twice for the same number of
updates, from the same base policy, with the real runner (Ray actors, embedded samplers, Megatron-core
trainer):
- sync:  the batcher with max_staleness = 0, stale = "wait": the prompts of update v+1 start only once
         version v is trained and pushed (generate, then train);
- async: the plan's batcher as is (unlimited staleness, `inflight_prompts` generating at all times).
It reports the update loop's wall seconds (first prompts -> last update; start-up excluded), seconds per
update, the trainer-idle share of the loop, and the speed-up, as JSON (benchmarks/results/async_vs_sync.json).
Goal: async at least 1.5x faster.

    python benchmarks/async_vs_sync.py [--plan data/plans/tiny-cpu.toml] [--updates 8] [--init CKPT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "async_vs_sync.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default="data/plans/tiny-cpu.toml")
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--init", default=None, help="base policy checkpoint (default: the cached pretrain)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--keep", default=None, help="keep the two run logs under this folder")
    args = ap.parse_args()

    import torch
    from mixfleet.policies.plan import load_plan
    from mixfleet.runner.orchestration.launcher import launch
    from mixfleet.runner.orchestration.recipe import base_policy, prepare_run

    torch.set_num_threads(1)
    plan = load_plan(args.plan)
    if args.init is None:
        args.init = base_policy(plan, say=None)        # the plan's cached `mixfleet pretrain` base
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="mixfleet-async-vs-sync-"))
    results: dict[str, dict] = {}
    for mode in ("sync", "async"):
        out = root / mode
        shutil.rmtree(out, ignore_errors=True)
        run = prepare_run(plan, {"embedded.eval_every": 0}, out, updates=args.updates, init=args.init, mode=mode,
                          say=None, where="async_vs_sync")       # the recipe every run of a plan goes through
        t0 = time.perf_counter()
        load_before = os.getloadavg()[0]
        try:
            res = launch(run.plan, run.config, say=None).result
        finally:
            run.release()
        from mixfleet.costmodel.records.runlog import RunLog

        log = RunLog.open(out)
        up = log.updates.sort_values("version")
        results[mode] = {
            "updates": int(res["version"]), "loop_s": res["loop_s"], "s_per_update": res["loop_s"] / args.updates,
            "trainer_busy_s": res["loop_trainer_busy_s"], "trainer_idle_share": res["loop_trainer_idle_share"],
            "total_wall_s": time.perf_counter() - t0, "staleness_mean": float(up["staleness_mean"].mean()),
            "staleness_max": float(up["staleness_max"].max()), "reward_mean": float(up["reward_mean"].mean()),
            "train_step_s_mean": float(up["train_step_s"].mean()),
            "cpu_s_total": float(log.header.get("cpu_s_total", float("nan"))),
            "restarts": int((log.events["kind"] == "restart").sum()),
            "loadavg_1min_before_after": [load_before, os.getloadavg()[0]],   # other work on the machine
        }
        print(f"{mode:5s}: {res['loop_s']:.1f} s for {args.updates} updates "
              f"({results[mode]['s_per_update']:.1f} s/update), trainer idle {res['loop_trainer_idle_share']:.0%}, "
              f"staleness mean {results[mode]['staleness_mean']:.2f}", flush=True)
    speedup = results["sync"]["loop_s"] / results["async"]["loop_s"]
    doc = {"benchmark": "async_vs_sync", "plan": plan.name, "updates": args.updates, "init": args.init,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
           "results": results, "speedup_async_over_sync": speedup, "goal_speedup": 1.5,
           "meets_goal": speedup >= 1.5, "created_unix_s": time.time()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"speed-up async / sync: {speedup:.2f}x (goal 1.5x) -> {args.out}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
