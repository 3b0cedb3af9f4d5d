"""The re-planning loop (issue 27 items 1-2): the `replan` autoscaler, the twin's truth, the fit on a window.

A tiny CPU plan (three groups, one replica = one CPU) dry-run in the twin on a truth where cpu-bf16 is 2.5x slower
than its prior: the re-planner's fit finds it (decode_scale ~2.5), its decision is a `replan` event with before /
after counts, fitted values with stderr and the predicted gain, and the run's groups follow the new counts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mixfleet.costmodel.calibration.fit import calibrate
from mixfleet.costmodel.calibration.logs import FrameLog
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import EventRecord, RunLog, RunLogWriter
from mixfleet.planner.solver import planner_solver
from mixfleet.policies.plan import Plan, load_plan, with_overrides
from mixfleet.policies.registry import make, make_config
from mixfleet.policies.replan import Proposal
from mixfleet.twin.replan import perturbed_truth
from mixfleet.twin.sim import simulate

SLOW = 0.4    # cpu-bf16's true speed, x its prior


def tiny_pool(**autoscaler: object) -> Plan:
    plan = load_plan("tiny-cpu")
    over: dict[str, object] = {"policies.autoscaler.name": "replan", "policies.autoscaler.interval_s": 2.0}
    for g in plan.groups:
        over[f"groups.{g.name}.min_replicas"] = 1
        over[f"groups.{g.name}.max_replicas"] = 4
        over[f"groups.{g.name}.replicas"] = 2
    over.update({f"policies.autoscaler.{k}": v for k, v in autoscaler.items()})
    return with_overrides(plan, over)


def replans(log_dir: Path) -> list[dict]:
    ev = RunLog.open(log_dir).events
    return [{"version": int(r.version), **json.loads(r.detail)} for r in ev[ev["kind"] == "replan"].itertuples()]


@pytest.fixture(scope="module")
def slowed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    plan = tiny_pool()
    out = tmp_path_factory.mktemp("replan") / "run"
    simulate(plan, updates=20, truth=perturbed_truth(plan, slower={"cpu-bf16": SLOW}), out=out, warm_start=True)
    return out


def test_the_fit_finds_the_slow_group_and_the_decision_is_logged(slowed_run: Path) -> None:
    ds = replans(slowed_run)
    assert ds, "no replan event"
    first = ds[0]
    assert set(first) >= {"adopted", "reason", "trigger", "before", "after", "gain", "predicted", "fitted", "window"}
    assert first["trigger"].startswith("drift") and "cpu-bf16.decode_scale" in first["trigger"]
    value, stderr = first["fitted"]["cpu-bf16"]["decode_scale"]
    assert value == pytest.approx(1 / SLOW, rel=0.15) and 0 < stderr < 0.1 * value
    for g in ("cpu-fp8", "cpu-nvfp4"):   # the groups at their prior fit near 1
        assert first["fitted"][g]["decode_scale"][0] == pytest.approx(1.0, rel=0.15)
    assert first["adopted"] and first["gain"] >= 0.03
    assert first["after"]["cpu-bf16"] < first["before"]["cpu-bf16"]
    assert first["predicted"]["new"] < first["predicted"]["now"]


def test_the_world_follows_the_new_counts_and_holds(slowed_run: Path) -> None:
    ds = replans(slowed_run)
    first = next(d for d in ds if d["adopted"])
    later = [d for d in ds if d["adopted"] and d["version"] > first["version"]]
    hold = make_config("autoscaler", "replan", {}).hold_updates
    assert all(d["version"] - first["version"] >= hold for d in later)   # hysteresis: no change inside the hold
    g = RunLog.open(slowed_run).groups
    settled = g[g["version"] >= first["version"] + 2]   # the autoscaler's next tick (2 s) is within an update
    for name, n in first["after"].items():
        if not later:
            assert settled[settled["group"] == name]["replicas_up"].round(6).eq(n).all(), name


def test_only_the_groups_the_plan_names_move(tmp_path: Path) -> None:
    plan = tiny_pool(groups=["cpu-fp8"])
    simulate(plan, updates=20, truth=perturbed_truth(plan, slower={"cpu-bf16": SLOW}), out=tmp_path / "r",
             warm_start=True)
    for d in replans(tmp_path / "r"):
        assert d["after"]["cpu-bf16"] == 2 and d["after"]["cpu-nvfp4"] == 2


def test_truth_runs_the_world_while_the_header_says_so(tmp_path: Path) -> None:
    plan = load_plan("tiny-cpu")
    truth = perturbed_truth(plan, slower={"cpu-bf16": SLOW})
    a = simulate(plan, updates=4, out=tmp_path / "prior")
    b = simulate(plan, updates=4, truth=truth, out=tmp_path / "truth")
    assert b.summary.time_per_update_mean_s > a.summary.time_per_update_mean_s
    assert "truth" in RunLog.open(tmp_path / "truth").header and "truth" not in RunLog.open(tmp_path / "prior").header


def test_calibrate_on_frames_is_calibrate_on_the_folder(tmp_path: Path) -> None:
    simulate("tiny-cpu", updates=8, out=tmp_path / "r")
    log = RunLog.open(tmp_path / "r")
    frame = FrameLog(header=log.header, trajectories=log.trajectories, updates=log.updates, groups=log.groups,
                     events=log.events)
    a, b = calibrate([tmp_path / "r"]), calibrate([frame])
    for ga, gb in zip(a.groups, b.groups, strict=True):
        assert ga.decode_scale.value == gb.decode_scale.value and ga.kl_k3.value == gb.kl_k3.value


def test_the_writer_appends_what_an_observer_returns(tmp_path: Path) -> None:
    seen = []

    def obs(r: object) -> list[EventRecord]:
        seen.append(r)
        return [EventRecord(time_s=1.0, kind="replan")] if getattr(r, "kind", "") == "note" else []

    with RunLogWriter(tmp_path / "w", {"source": "twin"}) as w:
        w.observe(obs)
        w.append(EventRecord(time_s=0.0, kind="note"))
    ev = RunLog.open(tmp_path / "w").events
    assert list(ev["kind"]) == ["note", "replan"] and len(seen) == 2


def _proposal(**kw: float) -> Proposal:
    base = dict(counts={"a": 1, "b": 3}, objective_now=10.0, objective_new=9.0, time_per_update_now_s=1.0,
                time_per_update_new_s=1.0, staleness_now=2.0, staleness_new=2.0, feasible=True)
    return Proposal(**{**base, **kw})


def test_min_gain_and_the_staleness_bound_decide() -> None:
    a = make("autoscaler", "replan", {"min_gain": 0.05, "max_staleness": 3.0})
    before = {"a": 2, "b": 2}
    assert a._judge(_proposal(), before, {"a": 1, "b": 3})[0]                       # 10% > 5%
    assert not a._judge(_proposal(objective_new=9.8), before, {"a": 1, "b": 3})[0]   # 2% < 5%
    assert not a._judge(_proposal(), before, dict(before))[0]                        # nothing to change
    assert not a._judge(_proposal(staleness_new=3.5), before, {"a": 1, "b": 3})[0]   # over the bound
    assert not a._judge(_proposal(feasible=False), before, {"a": 1, "b": 3})[0]
    assert math.isnan(_proposal(objective_now=math.inf).gain)


@pytest.mark.parametrize(("field", "value"), [("objective", "cheapest"), ("min_gain", 1.5), ("groups", "cpu-fp8"),
                                              ("window_updates", 1), ("max_staleness", -1.0)])
def test_bad_settings_are_refused_by_name(field: str, value: object) -> None:
    with pytest.raises(SpecError) as e:
        make_config("autoscaler", "replan", {field: value})
    assert field in str(e.value)


def test_a_group_the_plan_lacks_is_refused(tmp_path: Path) -> None:
    plan = tiny_pool(groups=["gpu-h100"])
    with pytest.raises(SpecError, match="gpu-h100"):
        simulate(plan, updates=2, out=tmp_path / "r")


def test_the_solver_moves_work_off_a_slow_group() -> None:
    plan = tiny_pool()
    cfg = make_config("autoscaler", "replan", {})
    names = tuple(g.name for g in plan.groups)
    start = {"cpu-bf16": 3, "cpu-fp8": 1, "cpu-nvfp4": 1}
    prior = planner_solver(plan, cfg)(None, start, names, {})
    slow = planner_solver(plan, cfg, perturbed_truth(plan, slower={"cpu-bf16": SLOW}))(None, start, names, {})
    assert slow.counts["cpu-bf16"] <= prior.counts["cpu-bf16"]
    assert slow.objective_new <= slow.objective_now


def test_the_cli_runs_the_world_on_a_truth_file(tmp_path: Path) -> None:
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    truth = perturbed_truth(load_plan("tiny-cpu"), slower={"cpu-bf16": SLOW}).save(tmp_path / "truth.toml")
    res = CliRunner().invoke(app, ["simulate", "tiny-cpu", "-n", "2", "--truth", str(truth), "--out",
                                   str(tmp_path / "log")])
    assert res.exit_code == 0, res.output
    assert "truth: the world ran on" in res.stdout
    header = RunLog.open(tmp_path / "log").header
    assert header["truth"]["groups"][0]["decode_scale"]["value"] == pytest.approx(1 / SLOW)


def test_the_solver_is_the_planners_for_a_replan_plan_only() -> None:
    # the twin's simulate and the runner's orchestrator both attach planner.solver.solver_for(plan) themselves
    # (tests/test_studies_replan.py starts a real studies run of a replan plan)
    from mixfleet.planner.solver import solver_for

    assert solver_for(load_plan("tiny-cpu")) is None            # a fixed fleet needs none
    plan = tiny_pool()
    solve = solver_for(plan)
    assert solve is not None
    p = solve(None, {g.name: g.replicas for g in plan.groups}, ("cpu-fp8",), {})
    assert set(p.counts) == {"cpu-bf16", "cpu-fp8", "cpu-nvfp4"} and p.counts["cpu-bf16"] == 2
