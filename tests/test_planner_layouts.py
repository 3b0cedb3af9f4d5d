"""Replica layouts in the planner and plans: the cheapest layout per token is chosen (not the smallest that
fits), plans record tp / dp_attention / ep, and the twin prices a recorded layout the same way."""

from __future__ import annotations

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import group_types
from mixfleet.planner.search import candidate_plan
from mixfleet.policies.plan import GroupPlan, Plan, plan_from_dict


def _cfg(**kw) -> PlannerConfig:
    return PlannerConfig(model="qwen3-235b-a22b", accelerators=("H200",),
                         precisions={"H200": ("fp8",)}, **kw)


def test_cheapest_layout_beats_the_smallest_that_fits_and_is_recorded_in_the_plan() -> None:
    smallest = group_types(_cfg())
    cheapest = group_types(_cfg(layouts="cheapest"))
    assert len(smallest) == len(cheapest) == 1
    s, c = smallest[0], cheapest[0]
    assert s.tp == 2 and s.dp_attention == 1  # the smallest TP that holds 235B in FP8 on H200
    assert c.usd_per_hour / c.tokens_per_s < s.usd_per_hour / s.tokens_per_s
    from mixfleet.planner.search import Candidate

    cand = Candidate(replicas={c.name: 2}, inflight_prompts=64, throughput_tokens_per_s=1.0, time_per_update_s=1.0,
                     staleness=0.0, usd_per_hour=1.0, cost_per_update_usd=1.0, cost_per_effective_update_usd=1.0,
                     kept_share=1.0, trainer_bound=False)
    plan = candidate_plan(cand, cheapest, _cfg(layouts="cheapest"))
    g = plan.groups[0]
    assert (g.tp, g.dp_attention, g.ep) == (c.tp, c.dp_attention, c.ep)
    again = plan_from_dict(plan.to_dict())
    assert again.groups[0] == g
    # the recorded layout prices the same replica when the plan is evaluated again
    from mixfleet.planner.search import evaluate_plan  # noqa: F401  (imported for its group_types path)

    same = group_types(_cfg(), only=[g])
    assert same[0].tokens_per_s == pytest.approx(c.tokens_per_s)


def test_layout_fields_are_validated() -> None:
    with pytest.raises(SpecError, match="divisible"):
        GroupPlan(name="g", accelerator="H200", precision="fp8", tp=0, dp_attention=4, ep=4)
    with pytest.raises(SpecError, match="cost_backend"):
        Plan(name="p", model="tiny", workload="tiny-cpu", cost_backend="magic",
             groups=(GroupPlan(name="g", accelerator="H200", precision="fp8"),))
    with pytest.raises(SpecError, match="layouts"):
        PlannerConfig(layouts="largest")
