"""The re-planner's solver anchors the trainer on the window's measured step (found on the first real re-planned run,
data/plans/replan-cpu.toml, issue 27 item 3): the model prices a batch at the plan's workload's tokens, and the real
run's batches were shorter, so the fitted trainer put the model's step at 79 s against 44 s measured: the model
called a run trainer-bound (staleness unbounded) that was not, and its time per update was 70% off the measured."""

from __future__ import annotations

import math
from dataclasses import replace

from mixfleet.planner.solver import solver_for
from mixfleet.policies.plan import load_plan
from mixfleet.twin.replan import perturbed_truth

MEASURED = {"time_per_update_s": 46.4, "staleness": 2.0}
TRAIN_STEP_S = 44.0


def _fit():   # noqa: ANN202
    plan = load_plan("data/plans/replan-cpu.toml")
    truth = perturbed_truth(plan, slower={"cpu-fast": 1 / 16, "cpu-slow": 1 / 32})   # the real run's fitted scales
    slow_trainer = replace(truth, trainer_scale=replace(truth.trainer_scale, value=34.0))   # the model step ~79 s
    return plan, slow_trainer


def test_the_trainer_is_anchored_on_the_measured_step() -> None:
    plan, fit = _fit()
    solve = solver_for(plan)
    assert solve is not None
    now, touch = {"cpu-fast": 1, "cpu-slow": 2}, ("cpu-fast", "cpu-slow")
    loose = solve(fit, now, touch, MEASURED)                 # no measured step: the model's own trainer
    assert loose.trainer_anchor == 1.0 and math.isinf(loose.staleness_now)
    assert loose.time_per_update_now_s > 1.4 * MEASURED["time_per_update_s"]
    p = solve(fit, now, touch, {**MEASURED, "train_step_s": TRAIN_STEP_S})
    assert 0.3 < p.trainer_anchor < 0.9
    assert abs(p.time_per_update_now_s / MEASURED["time_per_update_s"] - 1) < 0.03
    assert math.isfinite(p.staleness_now)
    assert p.counts["cpu-slow"] < now["cpu-slow"]            # still moves work off the slow group


def test_the_window_reports_its_train_step() -> None:
    from mixfleet.costmodel.records.runlog import UpdateRecord
    from mixfleet.policies.registry import make

    rp = make("autoscaler", "replan", {"window_updates": 2})
    for v, step in ((1, 10.0), (2, 40.0), (3, 44.0)):
        rp._updates.append(UpdateRecord(version=v, start_s=50.0 * v - step, end_s=50.0 * v, train_step_s=step,
                                        weight_sync_s=0.5, tokens=100, trajectories=8, staleness_mean=1.0,
                                        staleness_p50=1.0, staleness_p95=1.0, staleness_max=1,
                                        cost_sampler_usd=0.0, cost_trainer_usd=0.0))
    m = rp.measured()
    assert m["train_step_s"] == 42.0 and m["time_per_update_s"] == 50.0
