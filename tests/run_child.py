"""Child process of tests/test_run_faults.py: a small real run with fault drills, killed by the test.

Usage: python tests/run_child.py PLAN.toml OUT INIT UPDATES [--plain] [--resume]. Prints "UPDATE <v> <n> <up>"
after each update's checkpoint (the run log is flushed by then), n = trained trajectories so far that were
re-routed after the replica loss, up = replicas of the first group that are up. Drills (unless --plain): the
plan's second group fails its weight load of version 1 (a truncated checkpoint); after update 1 a replica of
the first group is killed while it serves requests (the weight drill is a hook this file installs:
`broken_load`).
--resume continues the run log in OUT.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import torch
from mixfleet.policies.plan import load_plan
from mixfleet.runner.orchestration.orchestrator import RunConfig, run_plan


def broken_load(out: Path, group: str, version: int):  # noqa: ANN201
    """A weight-source hook (WeightPublisher.source_for): `group` loads `version` from a copy of the export
    whose weights file is truncated, so its engine refuses the load for real and keeps its old weights."""

    def source_for(g: str, v: int, path: str) -> str:
        if (g, v) != (group, version):
            return path
        dst = out / "weights" / f".broken-v{v:06d}-{g}"
        shutil.copytree(path, dst, dirs_exist_ok=True)
        for f in dst.glob("*.safetensors"):
            f.write_bytes(f.read_bytes()[:64])
        return str(dst)

    return source_for


def main() -> None:
    torch.set_num_threads(1)
    plan_path, out, init, updates = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    plain, resume = "--plain" in sys.argv[5:], "--resume" in sys.argv[5:]
    plan = load_plan(plan_path)
    first = plan.groups[0].name
    cfg = RunConfig(out_dir=out, updates=updates, init_checkpoint=init, ray_num_cpus=2, resume=resume)

    def setup(orch) -> None:  # noqa: ANN001
        if not plain:              # the test's hook: the second group loads version 1 from a truncated copy
            orch.weights.source_for = broken_load(Path(out), plan.groups[1].name, 1)

    async def on_update(view, orch) -> None:  # noqa: ANN001
        if view.version == 1 and not plain:
            for _ in range(200):                     # kill it while it serves (its sessions must move)
                reps = [r for r in orch.replicas[first] if r.up and r.running > 0]
                if reps:
                    break
                await asyncio.sleep(0.05)
            orch.kill_replica(first, reps[0].index if reps else None)
        up = sum(1 for r in orch.replicas[first] if r.up)   # after the kill: has the replacement come up?
        print(f"UPDATE {view.version} {orch.trained_restarted} {up}", flush=True)

    run_plan(plan, cfg, on_update=on_update, setup=setup)


if __name__ == "__main__":
    main()
