"""Prefill under attention DP is accounted per DP rank (issue 25 item 3), as the engines run it and as
aiconfigurator's aggregated-serving estimate counts it (a rank's own batch, throughput x dp): each rank prefills
its own requests in the same forward as the other ranks', so one request costs a busy replica the forward's
time / dp_attention (`ReplicaModel.replica_prefill_s`). main charged a DEP8 replica the whole forward per
request (0.21 s per 1k-token prefill for Qwen3-235B on 8 H100, where TP8 takes 0.057 s)."""

from __future__ import annotations

import numpy as np
import pytest
from mixfleet.costmodel.steptime.measured import Layout
from mixfleet.costmodel.steptime.roofline import replica_model
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import group_types
from mixfleet.policies.plan import plan_from_dict
from mixfleet.twin.rates import build_setup

DP_PLAN = {"name": "dp", "seed": 0, "model": "qwen3-30b-a3b", "workload": "tiny-cpu", "price_table": "modal",
           "groups": [{"name": "H200-DEP4", "accelerator": "H200", "precision": "fp8", "tp": 4, "dp_attention": 4,
                       "ep": 4, "replicas": 1},
                      {"name": "H100-FP8", "accelerator": "H100", "precision": "fp8", "replicas": 1}]}


def _r(label: str, backend: str = "roofline", model: str = "qwen3-235b-a22b", acc: str = "H100"):
    return replica_model(model, acc, "fp8", "fp8_e4m3", layout=Layout.parse(label), kv_budget_tokens=2048,
                         backend=backend)


@pytest.mark.parametrize("backend", ["roofline", "aiconfigurator"])
def test_a_request_costs_a_dp_replica_its_ranks_share_of_the_forward(backend: str) -> None:
    dep, tp = _r("DEP8", backend), _r("TP8", backend)
    n = np.array([64.0, 1000.0, 1900.0])
    assert np.array_equal(tp.replica_prefill_s(n, 0), tp.prefill_s(n, 0))              # plain TP: one request
    assert np.allclose(dep.replica_prefill_s(n, 0), np.asarray(dep.prefill_s(n, 0)) / 8, rtol=1e-15)
    # one forward prefills a request on each of the 8 ranks: per request, no dearer than TP8 prefilling one
    assert float(dep.replica_prefill_s(1000, 0)) < float(tp.prefill_s(1000, 0))
    if backend == "aiconfigurator":   # the numbers: the forward 0.21 s, a request 0.026 s, TP8 0.056 s
        assert float(dep.prefill_s(1000, 0)) == pytest.approx(0.209, rel=0.05)
        assert float(tp.prefill_s(1000, 0)) == pytest.approx(0.056, rel=0.05)


def test_the_roofline_forward_of_a_dp_replica_holds_a_request_per_rank() -> None:
    # compute-bound (long prompt): the forward does dp requests' FLOPs, each rank its own on its tp GPUs (the
    # experts' over all GPUs), so per GPU one request's FLOPs / tp; per request, a TP-n replica's FLOP time
    dep, tp = _r("DEP8"), _r("TP8")
    n = 32768.0
    flops = 2.0 * dep.model.active_params * n + dep._attn_flops_per_key() * n * (n + 1) / 2
    flop_s = flops / (dep.peak_flops_per_s * dep.eff_flops)           # one request's FLOPs on one GPU
    comm_s = float(dep._comm_s(np.asarray(8 * n))) + dep.prefill_overhead_s      # all ranks' tokens' all-to-all
    assert float(dep.prefill_s(n, 0)) == pytest.approx(flop_s + comm_s, rel=1e-9)  # compute-bound
    assert flop_s / 8 <= float(dep.replica_prefill_s(n, 0)) <= float(tp.prefill_s(n, 0))   # TP8 adds all-reduces
    assert float(dep.prefill_s(0, 0)) == 0.0


def test_the_twin_and_the_planner_charge_a_request_per_rank() -> None:
    plan = plan_from_dict(DP_PLAN)
    s = build_setup(plan)
    dep = s.models["H200-DEP4"]
    for n in (2.0, 100.0, 1000.0):                         # on the rates' grid points and between them
        assert s.groups[0].rates.prefill_s(n) == pytest.approx(float(dep.replica_prefill_s(n)), rel=0.02)
    assert s.groups[0].rates.prefill_s(1024.0) == pytest.approx(float(dep.prefill_s(1024.0)) / 4, rel=1e-12)
    assert s.groups[1].rates.prefill_s(1024.0) == pytest.approx(float(s.models["H100-FP8"].prefill_s(1024.0)),
                                                                rel=1e-12)
    from mixfleet.costmodel.specs.workload import load_workload
    from mixfleet.planner.shape import workload_shape

    wl = load_workload(plan.workload)
    new = workload_shape(wl, wl.samples_per_prompt).new_tokens_per_turn
    t = group_types(PlannerConfig(model=plan.model, workload=plan.workload, verify=0), only=list(plan.groups))
    assert t[0].prefill_turn_s == float(dep.replica_prefill_s(new))
    assert t[1].prefill_turn_s == float(s.models["H100-FP8"].prefill_s(new))


def test_the_calibrations_duration_model_charges_prefill_as_the_twin_does() -> None:
    import dataclasses

    import pandas as pd
    from mixfleet.costmodel.calibration.sessions import _replica_features

    rm = build_setup(plan_from_dict(DP_PLAN)).models["H200-DEP4"]
    tr = pd.DataFrame({"start_s": [0.0], "end_s": [10.0], "generated_tokens": [100.0], "turns": [1.0],
                       "prompt_tokens": [800.0]})
    f = _replica_features(tr, rm, dataclasses.replace(rm, prefill_overhead_s=0.0))
    decode = 100.0 * float(rm.decode_step_s(1.0, (800.0 + 100.0) / 2))   # context: (prompt + generated) / 2
    assert f["work"].iloc[0] - decode == pytest.approx(float(rm.replica_prefill_s(800.0)), rel=1e-9)
