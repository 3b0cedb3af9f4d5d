"""The replica's layout is chosen at the batch the workload reaches (issue 25 item 3): `replica_model(layout=
"cheapest", load=ServingLoad(...))` prices every layout that fits at the operating point the load makes it reach
(what its KV holds of the load's requests, up to the load's running cap per attention-DP rank, prefill charged
per rank) and keeps the cheapest per token; the planner makes the same choice at its own load. main chose at a
fixed 256 requests per rank, decode only."""

from __future__ import annotations

import dataclasses

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.costmodel.specs.workload import load_workload
from mixfleet.costmodel.steptime.roofline import (
    ServingLoad,
    candidate_layouts,
    cheapest,
    kv_capacity_tokens,
    replica_model,
)
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import group_types, planner_load
from mixfleet.planner.shape import workload_shape

# 1k/1k offline: what TensorRT-LLM's max-throughput benchmark asks (up to 2048 running requests per DP rank)
LOAD = ServingLoad(context=1536.0, kv_per_request=2048.0, prefill_tokens=1024.0, reply_tokens=1024.0,
                   max_running=2048)


def _all_layouts(model: str, acc: str, prec: str, load: ServingLoad) -> dict[str, object]:
    spec, cat = load_model_spec(model), load_catalog()
    a = cat.accelerator(acc)
    out = {}
    for lay in candidate_layouts(spec, a.max_tp):
        if kv_capacity_tokens(spec, a, cat.precision(prec), cat.kv_dtype("fp8_e4m3"), lay.tp, lay.dp_attention) >= 2048:
            out[lay.label] = replica_model(spec, acc, prec, layout=lay, kv_budget_tokens=2048)
    return out


def test_the_cheapest_layout_is_taken_at_the_loads_operating_point_not_a_fixed_cap() -> None:
    every = _all_layouts("qwen3-30b-a3b", "B200", "nvfp4", LOAD)
    costs = {k: r.operating_point(LOAD).usd_per_mtoken for k, r in every.items()}
    chosen = replica_model("qwen3-30b-a3b", "B200", "nvfp4", layout="cheapest", load=LOAD, kv_budget_tokens=2048)
    assert chosen.layout.label == min(costs, key=costs.get) == "TP1"     # the publisher's layout for this row
    # at 256 per rank (main's fixed cap) the KV-rich TP1 replica is held to 256 and DEP8 looks cheaper
    capped = dataclasses.replace(LOAD, max_running=256)
    at_cap = replica_model("qwen3-30b-a3b", "B200", "nvfp4", layout="cheapest", load=capped, kv_budget_tokens=2048)
    assert at_cap.layout.label == "DEP8"
    reps = list(every.values())
    assert reps[cheapest(reps, capped)].layout.label == "DEP8"


def test_the_operating_point_is_the_batch_the_kv_holds_with_prefill_per_rank() -> None:
    dep = _all_layouts("qwen3-30b-a3b", "H200", "fp8", LOAD)["DEP4"]
    op = dep.operating_point(LOAD)
    b = min(dep.kv_capacity_tokens / 2048.0, 2048 * 4)
    assert op.batch == pytest.approx(b, rel=1e-12)
    decode = b / float(dep.decode_step_s(b, 1536.0))
    per_request = float(dep.prefill_s(1024.0)) / 4                     # each rank prefills its own requests
    assert op.prefill_s == pytest.approx(per_request, rel=1e-12)
    assert op.tokens_per_s == pytest.approx(1.0 / (1.0 / decode + per_request / 1024.0), rel=1e-12)
    assert op.tokens_per_s_per_gpu == pytest.approx(op.tokens_per_s / 4, rel=1e-12)
    assert op.usd_per_mtoken == pytest.approx(dep.price_usd_per_hour / 3600 / op.tokens_per_s * 1e6, rel=1e-12)
    with pytest.raises(SpecError, match="max_running"):
        ServingLoad(context=1.0, kv_per_request=1.0, max_running=0)


@pytest.mark.parametrize("model,acc,prec", [("qwen3-235b-a22b", "H200", "fp8"), ("qwen3-30b-a3b", "B200", "nvfp4")])
def test_the_planner_makes_replica_models_choice_at_its_load(model: str, acc: str, prec: str) -> None:
    cfg = PlannerConfig(model=model, accelerators=(acc,), precisions={acc: (prec,)}, layouts="cheapest", verify=0)
    (t,) = group_types(cfg)
    wl = load_workload(cfg.workload)
    load = planner_load(workload_shape(wl, wl.samples_per_prompt))
    rm = replica_model(model, acc, prec, layout="cheapest", load=load,
                       kv_budget_tokens=min(wl.max_context, load_model_spec(model).max_context))
    assert (t.tp, t.dp_attention, t.ep) == (rm.n_gpus, rm.dp_attention, rm.ep)
    assert t.tokens_per_s == rm.operating_point(load).tokens_per_s
