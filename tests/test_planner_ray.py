"""The planner's twin checks as Ray tasks (issue 27 item 5): the same verified figures, chosen mix and ranking as
the sequential path for the same seeds, on a real two-node Ray cluster (Ray's own `ray.cluster_utils.Cluster`,
each node a raylet with one CPU, bound to 127.0.0.1 as the runner's local Ray is) and on a local Ray started by
`ray_map` itself (what `mixfleet plan --workers N` does); and the planner says what ran the checks.

Kept small: the tiny model on the tiny-cpu workload, 2 candidates x 2 seeds of 3 updates each (4 tasks).
"""

from __future__ import annotations

import functools

import pytest
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.search import plan_mix, sequential_map
from mixfleet.runner.orchestration import local_ray
from mixfleet.runner.orchestration.ray_map import ray_map
from mixfleet.twin.checks import twin_check

pytest.importorskip("ray")
START_ATTEMPTS = 3

CFG = PlannerConfig(model="tiny", workload="tiny-cpu", accelerators=("H100", "A100-80GB"),
                    max_gpus={"H100": 4, "A100-80GB": 2}, trainer_accelerator="H100", trainer_gpus=1,
                    verify=2, verify_seeds=2, verify_updates=3)


@pytest.fixture(scope="module")
def sequential():
    r = plan_mix(CFG, check=twin_check, check_map=sequential_map)   # the reference path (one after another)
    assert r.checks["mode"] == "sequential" and r.checks["tasks"] == 4 and r.checks["workers"] == 1
    return r


def _same(a, b) -> None:  # noqa: ANN001
    assert [c.replicas for c in a.verified] == [c.replicas for c in b.verified]       # the same ranking
    assert [c.verified for c in a.verified] == [c.verified for c in b.verified]       # bit-identical figures
    assert a.best == b.best and a.plan.to_dict() == b.plan.to_dict()
    assert all(len(c.verified["seeds"]) == 2 for c in a.verified)


@pytest.mark.slow
def test_checks_on_a_two_node_ray_cluster_match_the_sequential_path(sequential) -> None:  # noqa: ANN001
    import ray
    from ray.cluster_utils import Cluster

    local_ray.loopback_only()
    token = local_ray.new_token()
    local_ray.record_local_ray(token)
    args = {"num_cpus": 1, "node_ip_address": local_ray.LOOPBACK, "env_vars": {"OMP_NUM_THREADS": "1"}}
    with local_ray.marking(token):
        for attempt in range(START_ATTEMPTS):     # Ray's own startup timeout on a busy shared machine
            cluster = Cluster(initialize_head=False)
            try:
                cluster.add_node(**args, include_dashboard=False)
                cluster.add_node(**args)
                break
            except Exception as e:  # noqa: BLE001
                cluster.shutdown()
                if attempt == START_ATTEMPTS - 1 or "timed out during startup" not in str(e):
                    raise
    local_ray.record_local_ray(token, started=True)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        r = plan_mix(CFG, check=twin_check, check_map=functools.partial(ray_map, address=cluster.address))
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()
    _same(sequential, r)
    assert r.checks["mode"] == "ray" and r.checks["tasks"] == 4
    assert r.checks["nodes"] == 2 and r.checks["workers"] >= 2        # spread over both nodes
    assert r.checks["wall_s"] > 0


@pytest.mark.slow
def test_checks_on_a_local_ray_started_for_them_match_the_sequential_path(sequential) -> None:  # noqa: ANN001
    import ray

    r = plan_mix(CFG, check=twin_check, check_map=functools.partial(ray_map, workers=2))
    assert not ray.is_initialized()                                    # the Ray it started is shut down
    _same(sequential, r)
    assert r.checks["mode"] == "ray" and r.checks["nodes"] == 1 and 1 <= r.checks["workers"] <= 2
