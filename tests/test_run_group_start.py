"""A sampler group none of whose replicas can start fails the run, or (allowed) is left out and reported.

Real runs (tiny model, Ray actors, Megatron-core trainer): the plan's second group is started from a
truncated checkpoint (the `SamplerFleet.start_launch` hook), so its engine refuses it for real at every
start. Before this check the run logged a "crash" per try, restarted it forever and finished with exit
code 0 without that group. Now: `MAX_START_FAILURES` failed starts in a row with none up fail the run with
`RunFailed` naming the group (run log closed "failed"), or, with `allow_group_loss`, the group is given
up (event "group_lost", no more restarts), the run finishes on the other group and its summary and
run.json name the lost group (`mixfleet run` then exits 3).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.policies.plan import load_plan
from mixfleet.runner.orchestration.orchestrator import RunConfig, RunFailed, run_plan
from mixfleet.runner.orchestration.sampler_fleet import MAX_START_FAILURES
from mixfleet.runner.sampler.replica import ReplicaLaunch
from runplans import CPU_BF16, CPU_FP8, FIXED_EVERY_1S, run_files, run_plan_toml

pytestmark = pytest.mark.slow

PLAN = run_plan_toml(
    "group-start-test", [{**CPU_BF16, "name": "cpu-good"}, {**CPU_FP8, "name": "cpu-broken"}],
    trainer={"loss": "sc_mis"}, autoscaler=FIXED_EVERY_1S,
    batcher={"prompts_per_update": 2, "samples_per_prompt": 2, "inflight_prompts": 4},
    embedded={"max_turns": 2, "max_new_tokens": 8})


@pytest.fixture(scope="module")
def setup_files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("group-start")
    init, plan_path = run_files(root, PLAN)
    broken = root / "broken"
    shutil.copytree(init, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:64])            # cut: the engine refuses to load it
    return {"root": root, "init": str(init), "broken": str(broken), "plan": load_plan(plan_path)}


def _run(files: dict, name: str, **cfg: object) -> tuple[Path, dict | BaseException]:
    out = files["root"] / name
    config = RunConfig(out_dir=out, updates=1, init_checkpoint=files["init"], ray_num_cpus=2, **cfg)

    def setup(orch) -> None:  # noqa: ANN001
        def broken_start(launch: ReplicaLaunch) -> ReplicaLaunch:
            if launch.group != "cpu-broken":
                return launch
            return dataclasses.replace(launch, model_path=files["broken"], weights=None)

        orch.fleet.start_launch = broken_start

    try:
        return out, run_plan(files["plan"], config, setup=setup)
    except RunFailed as e:
        return out, e


def _start_failures(out: Path, group: str) -> int:
    ev = RunLog.open(out).events
    crash = ev[(ev["kind"] == "crash") & (ev["group"] == group)]
    return int(crash["detail"].str.startswith("start failed").sum())


def test_a_group_that_cannot_start_fails_the_run(setup_files: dict) -> None:
    out, res = _run(setup_files, "fails")
    assert isinstance(res, RunFailed), f"the run went on without the group: {res}"
    msg = str(res)
    print("\nRunFailed:", msg)
    assert "'cpu-broken' cannot start" in msg and "--allow-group-loss" in msg
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert _start_failures(out, "cpu-broken") == MAX_START_FAILURES
    assert _start_failures(out, "cpu-good") == 0


def test_an_allowed_group_loss_is_reported(setup_files: dict) -> None:
    out, res = _run(setup_files, "allowed", allow_group_loss=True)
    assert isinstance(res, dict), res
    assert res["version"] == 1
    assert set(res["lost_groups"]) == {"cpu-broken"}
    header = json.loads((out / "run.json").read_text())
    assert header["status"] == "finished" and set(header["lost_groups"]) == {"cpu-broken"}
    log = RunLog.open(out)
    lost = log.events[log.events["kind"] == "group_lost"]
    assert list(lost["group"]) == ["cpu-broken"]
    assert json.loads(lost["detail"].iloc[0])["starts_failed"] == MAX_START_FAILURES
    assert _start_failures(out, "cpu-broken") == MAX_START_FAILURES      # given up: no more restarts
    traj = log.trajectories
    assert set(traj[traj["trained_version"] == 1]["group"]) == {"cpu-good"}


def test_mixfleet_run_exit_codes(setup_files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mixfleet run`: 1 and the reason when the group cannot start; 3 and a warning when it was allowed."""
    from mixfleet.runner.orchestration import sampler_fleet
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    def broken_start(launch: ReplicaLaunch) -> ReplicaLaunch:  # installed as every fleet's default hook
        if launch.group != "cpu-broken":
            return launch
        return dataclasses.replace(launch, model_path=setup_files["broken"], weights=None)

    monkeypatch.setattr(sampler_fleet, "_same_launch", broken_start)
    plan = str(setup_files["root"] / "plan.toml")
    base = ["run", plan, "--updates", "1", "--init", setup_files["init"], "--eval-every", "0", "--quiet"]
    r = CliRunner().invoke(app, [*base, "--out", str(setup_files["root"] / "cli-fails")])
    print("\n", r.output[-600:])
    assert r.exit_code == 1, r.output
    assert "the run failed: sampler group 'cpu-broken' cannot start" in r.output
    r = CliRunner().invoke(app, [*base, "--out", str(setup_files["root"] / "cli-allowed"), "--allow-group-loss"])
    print(r.output[-600:])
    assert r.exit_code == 3, r.output
    assert "done: version 1" in r.output and "'cpu-broken' never started and was left out" in r.output
