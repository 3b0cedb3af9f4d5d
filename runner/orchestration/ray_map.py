"""Independent jobs as Ray tasks: `ray_map(fn, jobs)` runs `fn(*job)` for every job on a Ray cluster and returns
the results in the jobs' order with what ran them.

The planner's twin checks (`mixfleet.twin.checks.twin_check`, one per candidate and seed) go through here when
`mixfleet plan` is given `--workers N` (a local Ray of N CPUs, started as the runner starts one:
`actors.init_ray`, bound to 127.0.0.1 and never left behind) or `--address` (a running cluster). Nothing here
knows the twin (runner imports no twin): `fn` is any picklable module-level function, and each task is one call
of it in a worker process with one CPU, so results are those of the sequential path for the same arguments
(a job carries its own seed). The tasks are spread over the nodes (`SPREAD`). What ran them: `workers` distinct
worker processes, on `nodes` distinct nodes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from mixfleet.costmodel.errors import SpecError


def _call(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, int, str]:
    """One job in a Ray worker: its result, the worker's pid and node id."""
    import ray

    return fn(*args), os.getpid(), ray.get_runtime_context().get_node_id()


def ray_map(fn: Callable[..., Any], jobs: list[tuple[Any, ...]], *, workers: int = 0, address: str | None = None
            ) -> tuple[list[Any], dict[str, Any]]:
    """`[fn(*job) for job in jobs]` as Ray tasks (one CPU each, spread over the nodes), and what ran them:
    {"mode": "ray", "address": ..., "workers": distinct worker processes, "nodes": distinct nodes}.

    Uses the Ray this process is already connected to; else connects to `address`, or starts a local Ray with
    `workers` CPUs (0: this machine's CPUs), and shuts down what it started."""
    import ray

    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise SpecError("plan", "workers", workers, "an integer >= 0 (0: this machine's CPUs)")
    started = not ray.is_initialized()
    if started:
        from mixfleet.runner.orchestration.actors import init_ray

        init_ray(address=address, num_cpus=workers or (os.cpu_count() or 1))
    try:
        task = ray.remote(num_cpus=1, max_retries=0, scheduling_strategy="SPREAD")(_call)
        out = ray.get([task.remote(fn, tuple(job)) for job in jobs])
        used_address = ray.get_runtime_context().gcs_address
    finally:
        if started:
            ray.shutdown()
    return [r for r, _, _ in out], {"mode": "ray", "address": address or used_address,
                                    "workers": len({(node, pid) for _, pid, node in out}),
                                    "nodes": len({node for _, _, node in out})}
