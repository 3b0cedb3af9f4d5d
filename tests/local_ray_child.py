"""Child process of tests/test_local_ray.py: a real run's local Ray with one embedded sampler replica, then idle.

Usage: python tests/local_ray_child.py CHECKPOINT. Starts the Ray as the runner does (init_ray, the plan's
accelerator as a resource), starts one sampler actor on CHECKPOINT, prints "READY <json>" and sleeps until killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

from mixfleet.runner.orchestration.actors import init_ray, remote_sampler


def main() -> None:
    init_ray(num_cpus=1, resources={"cpu": 2.0})
    import ray

    actor = remote_sampler(accelerator="cpu").remote(group="cpu-bf16", index=0, model_path=sys.argv[1],
                                                     precision="bf16", kv_dtype="bf16", max_running_requests=4)
    info = ray.get(actor.info.remote(), timeout=300)
    print("READY " + json.dumps({"pid": os.getpid(), "url": info["url"], "actor_pid": info["pid"]}), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
