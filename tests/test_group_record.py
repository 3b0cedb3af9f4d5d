"""A plan group has one record per world on the runner's side (issue 25 item 1): the fleet's `GroupSpec` wraps
the group `planspec.resolve_groups` resolves (the twin's record), each replica is started from one frozen
`ReplicaLaunch` (`GroupSpec.launch`), and the embedded engine's settings and the SGLang command are each
derived from that record in one function (`replica.embedded_settings`, `sglang_launch.spec_for_replica`).

Before: the group went GroupPlan -> GroupSpec (its fields copied) -> a kwargs dict -> SamplerWorker's 22
keywords -> a dict for `spec_for_group` (which took `kv_dtype` or `kv_cache_dtype`); placement read the
fleet's private `_starting`.
"""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from mixfleet.costmodel.plan.planspec import resolve_groups
from mixfleet.policies.plan import plan_from_dict
from mixfleet.runner.orchestration.actors import SamplerWorker
from mixfleet.runner.orchestration.fleet import fleet_from_plan
from mixfleet.runner.sampler.replica import EMBEDDED_MAX_RUNNING, ReplicaLaunch, embedded_settings
from mixfleet.runner.sampler.sglang_launch import launch_argv, spec_for_replica
from sampler_helpers import make_checkpoint

RAW = {"name": "p", "model": "qwen3-30b-a3b", "workload": "tiny-cpu",
       "trainer": {"accelerator": "H200", "gpus": 8},
       "groups": [{"name": "dep", "accelerator": "H200", "precision": "fp8", "kv_dtype": "fp8_e4m3", "tp": 4,
                   "dp_attention": 4, "ep": 4, "replicas": 3},
                  {"name": "tp1", "accelerator": "B200", "precision": "nvfp4", "kv_dtype": "fp8_e4m3",
                   "replicas": 2}],
       "embedded": {"max_replicas_per_group": 1}}


def test_the_fleets_group_is_the_resolved_group() -> None:
    plan = plan_from_dict(RAW)
    resolved = resolve_groups(plan)
    for mode in ("sglang", "embedded"):
        fleet = fleet_from_plan(plan, mode=mode)
        for g, r in zip(fleet.groups, resolved, strict=True):
            assert g.resolved.group == r.group                     # the plan's group, not a copy of its fields
            assert (g.name, g.accelerator, g.precision, g.kv_dtype) == \
                (r.group.name, r.group.accelerator, r.group.precision, r.group.kv_dtype)
            assert g.planned_replicas == r.group.replicas and g.usd_per_mtoken == r.usd_per_mtoken
            assert g.usd_per_hour == r.prior.price_usd_per_hour
    dep, tp1 = fleet_from_plan(plan, mode="sglang").groups
    assert (dep.tp, dep.dp_attention, dep.ep) == (4, 4, 4)                 # GPUs per replica: tp
    assert dep.capacity_tokens_per_s == resolved[0].capacity_tokens_per_s
    emb = fleet_from_plan(plan, mode="embedded").groups[0]
    assert (emb.replicas, emb.tp, emb.dp_attention, emb.ep) == (1, 1, 1, 1)   # an embedded replica has no layout
    assert emb.capacity_tokens_per_s == pytest.approx(3 * resolved[0].capacity_tokens_per_s)


def test_a_replicas_launch_record_and_the_sglang_command_from_it() -> None:
    dep = fleet_from_plan(plan_from_dict(RAW), mode="sglang").groups[0]
    launch = dep.launch(index=2, model_path="/ckpt/v3", weight_version="7", top_p_replay=True, api_key="k" * 32)
    assert (launch.group, launch.index, launch.mode, launch.precision, launch.kv_dtype) == \
        ("dep", 2, "sglang", "fp8", "fp8_e4m3")
    assert (launch.tp, launch.dp_attention, launch.ep) == (4, 4, 4)
    assert "k" * 32 not in repr(launch)                            # the key is never shown
    with pytest.raises(dataclasses.FrozenInstanceError):
        launch.precision = "bf16"                                  # type: ignore[misc]
    argv = launch_argv(spec_for_replica(launch, model_path="/node/v7", port=30001))
    assert argv[:10] == ["python", "-m", "sglang.launch_server", "--model-path", "/node/v7", "--host", "127.0.0.1",
                         "--port", "30001", "--tp-size"]
    assert argv[10:] == ["4", "--dp-size", "4", "--enable-dp-attention", "--ep-size", "4", "--quantization", "fp8",
                         "--kv-cache-dtype", "fp8_e4m3", "--sampling-mask-max-tokens", "512", "--weight-version",
                         "7", "--api-key", "k" * 32]


@pytest.mark.parametrize("change, message", [
    ({"mode": "cloud"}, "sampler replica g#0: mode = 'cloud'; allowed: embedded, sglang"),
    ({"precision": "int4"}, "sampler replica g#0: precision = 'int4'; allowed: "),
    ({"kv_dtype": "fp8_e5m2"}, "sampler replica g#0: kv_dtype = 'fp8_e5m2'; allowed: "),
    ({"tp": 0}, "sampler replica g#0: tp = 0; allowed: an integer >= 1"),
    ({"model_path": ""}, "sampler replica g#0: model_path = ''; allowed: a checkpoint folder"),
])
def test_a_bad_launch_record_is_refused_naming_the_field(change: dict, message: str) -> None:
    good = {"group": "g", "index": 0, "mode": "embedded", "precision": "bf16", "kv_dtype": "bf16", "model_path": "/m"}
    ReplicaLaunch(**good)
    with pytest.raises(ValueError, match=message.replace("(", "\\(")):
        ReplicaLaunch(**{**good, **change})


def test_an_embedded_replica_starts_from_its_launch_record(tmp_path) -> None:  # noqa: ANN001
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=0, weight_version="0")
    group = fleet_from_plan(plan_from_dict(RAW), mode="embedded").groups[1]        # nvfp4 weights, fp8 KV
    launch = group.launch(index=0, model_path=str(ckpt), weight_version="3", seed=11, api_key="s" * 32)
    engine_kw, server = embedded_settings(launch, model_path=str(ckpt), host="127.0.0.1")
    assert (engine_kw["precision"], engine_kw["kv_cache_dtype"], engine_kw["seed"]) == ("nvfp4", "fp8_e4m3", 11)
    assert server.max_running_requests == engine_kw["max_running_requests"] == EMBEDDED_MAX_RUNNING
    with pytest.raises(ValueError, match="embedded_settings of a 'sglang' replica"):
        embedded_settings(dataclasses.replace(launch, mode="sglang"), model_path=str(ckpt), host="127.0.0.1")
    worker = SamplerWorker(launch)                                  # in process: no Ray
    try:
        info = worker.info()
        assert (info["group"], info["index"], info["mode"], info["host"]) == ("tp1", 0, "embedded", "127.0.0.1")
        headers = {"Authorization": f"Bearer {'s' * 32}"}
        with httpx.Client(base_url=worker.url, trust_env=False, headers=headers, timeout=30) as http:
            assert http.get("/health").status_code == 200
            assert http.get("/get_model_info").json()["weight_version"] == "3"
            served = http.get("/get_server_info").json()
        assert served["mixfleet"]["precision"] == "nvfp4" and served["mixfleet"]["kv_cache_dtype"] == "fp8_e4m3"
        assert httpx.get(f"{worker.url}/get_model_info", trust_env=False).status_code == 401   # the key is required
    finally:
        worker.stop()
