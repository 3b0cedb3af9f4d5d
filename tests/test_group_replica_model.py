"""One function builds a plan group's replica cost model (costmodel/plan/resolve.py group_replica_model): the
twin, the planner, the runner's fleet and the calibration get the same numbers for the same group, and a
group the cost model refuses is refused in every world (issue 12 item 1)."""

from __future__ import annotations

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.steptime.roofline import FitError
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import group_types
from mixfleet.policies.plan import load_plan, plan_from_dict
from mixfleet.runner.orchestration.fleet import fleet_from_plan
from mixfleet.twin.rates import build_setup


@pytest.mark.parametrize("name", ["seed-mixed", "tiny-cpu"])
def test_fleet_routing_weights_are_the_twins_capacities(name: str) -> None:
    plan = load_plan(name)
    twin = {g.name: g for g in build_setup(plan).groups}
    real = fleet_from_plan(plan, mode="sglang")
    for g in real.groups:
        assert g.capacity_tokens_per_s == twin[g.name].capacity_tokens_per_s      # bit for bit
        assert g.usd_per_mtoken == twin[g.name].usd_per_mtoken
    cfg = PlannerConfig(model=plan.model, workload=plan.workload, trainer_accelerator=plan.trainer.accelerator,
                        trainer_gpus=plan.trainer.gpus)
    assert [t.tp for t in group_types(cfg, only=list(plan.groups))] == [g.tp for g in real.groups]  # its GPUs


def test_a_group_that_does_not_fit_is_an_error_in_the_fleet_as_in_the_twin() -> None:
    # main: the fleet caught the cost model's FitError and gave the group a routing weight of 1 token/s (the
    # H100 group: ~600), so capacity-proportional routing starved it without a word; the twin refused the plan
    raw = {"name": "p", "model": "qwen3.6-35b-a3b", "workload": "seed-agentic-coding",
           "groups": [{"name": "a", "accelerator": "H100", "precision": "fp8", "replicas": 2},
                      {"name": "b", "accelerator": "A100-80GB", "precision": "bf16", "tp": 1, "replicas": 2}]}
    plan = plan_from_dict(raw)
    with pytest.raises(FitError, match="A100-80GB"):
        build_setup(plan)
    for mode in ("sglang", "embedded"):
        with pytest.raises(FitError, match="A100-80GB"):
            fleet_from_plan(plan, mode=mode)


def test_an_emulated_format_needs_the_plans_emulated_flag_in_the_runner_too() -> None:
    # main: the fleet forced emulated=True, so the runner ran (with emulated speeds as routing weights) a group
    # the twin refused; now the plan says it once, at load
    raw = {"name": "p", "model": "tiny", "workload": "tiny-cpu",
           "groups": [{"name": "a", "accelerator": "CPU-2core", "precision": "fp8", "replicas": 1}]}
    with pytest.raises(SpecError, match="emulated"):
        plan_from_dict(raw)
    raw["groups"][0]["emulated"] = True
    fleet = fleet_from_plan(plan_from_dict(raw))
    assert fleet.groups[0].capacity_tokens_per_s == build_setup(plan_from_dict(raw)).groups[0].capacity_tokens_per_s


def test_an_attention_dp_groups_capacity_is_the_same_in_both_worlds() -> None:
    # main: the fleet capped the batch at 256 x dp_attention (as the twin's rates do), the twin's routing capacity
    # at 256, so a dp-attention group weighed 3.6x more in the runner (129k vs 36k tokens/s) than in the twin
    raw = {"name": "p", "model": "qwen3-30b-a3b", "workload": "tiny-cpu",
           "groups": [{"name": "a", "accelerator": "H200", "precision": "fp8", "tp": 4, "dp_attention": 4, "ep": 4},
                      {"name": "b", "accelerator": "H100", "precision": "fp8"}]}
    plan = plan_from_dict(raw)
    twin = [g.capacity_tokens_per_s for g in build_setup(plan).groups]
    assert [g.capacity_tokens_per_s for g in fleet_from_plan(plan, mode="sglang").groups] == twin
