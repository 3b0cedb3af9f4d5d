"""Child process of tests/test_local_ray.py: a real run's local Ray with one embedded sampler replica, then idle.

Usage: python tests/local_ray_child.py CHECKPOINT. Starts the Ray as the runner does (init_ray, the plan's
accelerator as a resource), one sampler actor and the trainer actor (Megatron-core, torch.distributed) on
CHECKPOINT, prints "READY <json>" and sleeps until killed.
"""

from __future__ import annotations

import json
import os
import sys
import time

from mixfleet.runner.orchestration.actors import init_ray, remote_sampler, remote_trainer


def main() -> None:
    init_ray(num_cpus=1, resources={"cpu": 2.0})
    import ray
    from mixfleet.runner.sampler.replica import ReplicaLaunch

    actor = remote_sampler(accelerator="cpu").remote(ReplicaLaunch(group="cpu-bf16", index=0, mode="embedded",
                                                                   precision="bf16", kv_dtype="bf16",
                                                                   model_path=sys.argv[1]))
    trainer = remote_trainer().remote(init_from=sys.argv[1], state_dir=None,
                                      correction={"method": "sc_mis", "temperature": 1.0, "top_p_replay": False})
    info = ray.get(actor.info.remote(), timeout=300)
    ray.get(trainer.version.remote(), timeout=300)
    threads = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    worker_env = ray.get(ray.remote(num_cpus=0)(lambda: {k: os.environ.get(k) for k in threads}).remote(), timeout=300)
    print("READY " + json.dumps({"pid": os.getpid(), "url": info["url"], "actor_pid": info["pid"],
                                 "worker_env": worker_env, "driver_env": {k: os.environ.get(k) for k in threads}}),
          flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
