"""Fidelity on a repo plan (issue 42 item 4): the repo task's pool is the twin's (its cap declared once), the
workload's sandbox start latency, and the sandbox figures both sides of the check read from a run log
(`runsummary.sandbox_use`) on a hand-made log."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.plan.planspec import SandboxPlan, plan_sandbox, resolve_plan_sandbox, resolve_sandbox
from mixfleet.costmodel.records.runsummary import sandbox_use
from mixfleet.costmodel.specs.workload import load_workload, workload_from_dict
from mixfleet.policies.plan import load_plan, plan_from_dict


def repo_plan(**kw):
    return plan_from_dict({"name": "r", "model": "tiny", "workload": "tiny-cpu",
                           "groups": [{"name": "g", "accelerator": "CPU-2core", "precision": "bf16", "emulated": True}],
                           "embedded": {"task": "repo", "task_options": {"sandboxes": 6}}, **kw})


def wl(**kw):
    raw = {**load_workload("tiny-cpu").to_dict(), **kw}
    return workload_from_dict(raw)


def test_a_repo_plans_pool_is_its_task_options_sandboxes() -> None:
    sb = plan_sandbox(repo_plan())
    assert sb is not None and sb.max_live == 6 and sb.start_s is None
    assert plan_sandbox(repo_plan(sandbox={"max_live": 6, "start_s": 0.5})) == SandboxPlan(max_live=6, start_s=0.5)
    with pytest.raises(SpecError, match="task_options.sandboxes"):
        plan_sandbox(repo_plan(sandbox={"max_live": 8}))             # the cap declared twice, differently
    no_option = repo_plan(embedded={"task": "repo"}, sandbox={"max_live": 8})
    with pytest.raises(SpecError, match="task_options.sandboxes"):
        plan_sandbox(no_option)                                      # the real pool would not be 8
    assert plan_sandbox(repo_plan(embedded={"task": "repo"})) is None
    other = repo_plan(embedded={"task": "guess"})
    assert plan_sandbox(other) is None                               # not a repo plan: only a [sandbox] table
    shipped = load_plan("data/plans/repo-cpu-xval.toml")
    assert resolve_plan_sandbox(shipped).max_live == 8


def test_the_sandbox_start_comes_from_the_workload_unless_the_plan_sets_it() -> None:
    measured = wl(sandbox_start_s={"kind": "empirical", "values": [0.1, 0.3]})
    assert resolve_sandbox(SandboxPlan(max_live=4), workload=measured).start_s == pytest.approx(0.2)
    assert resolve_sandbox(SandboxPlan(max_live=4, start_s=2.0), workload=measured).start_s == 2.0
    assert resolve_sandbox(SandboxPlan(max_live=4), workload=wl()).start_s == 0.0   # the workload says nothing
    from mixfleet.twin.rates import build_setup

    setup = build_setup(repo_plan(), workload=measured)
    assert setup.sandbox.max_live == 6 and setup.sandbox.start_s == pytest.approx(0.2)
    assert setup.workload.prompts_per_update == load_workload("tiny-cpu").prompts_per_update  # the plan's batch


def test_sandbox_use_from_a_hand_made_log() -> None:
    tr = pd.DataFrame([
        # a runner's episode: two sandboxes, waits 1 + 0.5 s, its span 10 s -> 8.5 sandbox-seconds
        {"start_s": 0.0, "end_s": 10.0, "pool_wait_s": [1.0, 0.5], "sandbox_wait_s": math.nan},
        # a twin's episode: the scalar wait, 2 s of its 6 s span -> 4 sandbox-seconds
        {"start_s": 4.0, "end_s": 10.0, "pool_wait_s": None, "sandbox_wait_s": 2.0},
        # an episode without sandboxes: not counted
        {"start_s": 0.0, "end_s": 3.0, "pool_wait_s": None, "sandbox_wait_s": math.nan},
    ])
    use = sandbox_use(tr)
    assert (use.episodes, use.wait_s, use.held_s) == (2, 3.5, 12.5)
    assert use.wait_share == pytest.approx(3.5 / 16.0)
    assert use.cost_per_update_usd(3600.0, 5) == pytest.approx(12.5 / 5)   # 1 USD per sandbox-second
    assert math.isnan(sandbox_use(tr.iloc[2:]).wait_share)
