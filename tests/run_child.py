"""Child process of tests/test_run_faults.py: a small real run with fault drills, killed by the test.

Usage: python tests/run_child.py PLAN.toml OUT INIT UPDATES. Prints "UPDATE <v> <n> <up>" after each update's
checkpoint (the run log is flushed by then), n = trained trajectories so far that were re-routed after the
replica loss, up = replicas of the first group that are up. Drills: the plan's
second group fails its weight load of version 1 (a truncated checkpoint); after update 1 a replica of the
first group is killed while it serves requests.
"""

from __future__ import annotations

import asyncio
import sys

import torch
from mixfleet.policies.plan import load_plan
from mixfleet.runner.orchestration.orchestrator import RunConfig, run_plan


def main() -> None:
    torch.set_num_threads(1)
    plan_path, out, init, updates = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    plan = load_plan(plan_path)
    first, second = plan.groups[0].name, plan.groups[1].name
    cfg = RunConfig(out_dir=out, updates=updates, init_checkpoint=init, eval_every=0, trainer_threads=1,
                    inject_weight_load_failure={second: [1]}, ray_num_cpus=2)

    async def on_update(view, orch) -> None:  # noqa: ANN001
        if view.version == 1:
            for _ in range(200):                     # kill it while it serves (its sessions must move)
                reps = [r for r in orch.replicas[first] if r.up and r.running > 0]
                if reps:
                    break
                await asyncio.sleep(0.05)
            orch.kill_replica(first, reps[0].index if reps else None)
        up = sum(1 for r in orch.replicas[first] if r.up)   # after the kill: has the replacement come up?
        print(f"UPDATE {view.version} {orch.trained_restarted} {up}", flush=True)

    run_plan(plan, cfg, on_update=on_update)


if __name__ == "__main__":
    main()
