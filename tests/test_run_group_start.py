"""A sampler group none of whose replicas can start fails the run, or (allowed) is left out and reported.

Real runs (tiny model, Ray actors, Megatron-core trainer) through `mixfleet run`, one per case, shared by the
tests: the plan's second group is started from a truncated checkpoint (the fleet's start hook,
`sampler_fleet._same_launch`), so its engine refuses it for real at every start. Before this check the run
logged a "crash" per try, restarted it forever and finished with exit code 0 without that group. Now:
`MAX_START_FAILURES` failed starts in a row with none up fail the run with `RunFailed` naming the group (run log
closed "failed", `mixfleet run` exits 1), or, with `--allow-group-loss`, the group is given up (event
"group_lost", no more restarts), the run finishes on the other group and its summary and run.json name the
lost group (`mixfleet run` then exits 3).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import RunLog
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
    init, _ = run_files(root, PLAN)
    broken = root / "broken"
    shutil.copytree(init, broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:64])            # cut: the engine refuses to load it
    return {"root": root, "init": str(init), "broken": str(broken)}


def _broken_start(files: dict):  # noqa: ANN202
    def broken_start(launch: ReplicaLaunch) -> ReplicaLaunch:   # installed as every fleet's default hook
        if launch.group != "cpu-broken":
            return launch
        return dataclasses.replace(launch, model_path=files["broken"], weights=None)

    return broken_start


@pytest.fixture(scope="module")
def cli_runs(setup_files: dict) -> dict[str, tuple[Path, int, str]]:
    """The two runs every test here reads, each started once through `mixfleet run` (the CLI calls `run_plan`):
    "fails" (the group cannot start) and "allowed" (--allow-group-loss); name -> (run folder, exit code,
    output). Before issue 43 each test started its own runs (4 runs for 2 cases, ~40 s more)."""
    from mixfleet.runner.orchestration import sampler_fleet
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    plan = str(setup_files["root"] / "plan.toml")
    base = ["run", plan, "--updates", "1", "--init", setup_files["init"], "--eval-every", "0", "--quiet"]
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler_fleet, "_same_launch", _broken_start(setup_files))
        for name, extra in (("fails", []), ("allowed", ["--allow-group-loss"])):
            out = setup_files["root"] / name
            r = CliRunner().invoke(app, [*base, "--out", str(out), *extra])
            print(f"\n{name}:", r.output[-600:])
            runs[name] = (out, r.exit_code, r.output)
    return runs


def _start_failures(out: Path, group: str) -> int:
    ev = RunLog.open(out).events
    crash = ev[(ev["kind"] == "crash") & (ev["group"] == group)]
    return int(crash["detail"].str.startswith("start failed").sum())


def test_a_group_that_cannot_start_fails_the_run(cli_runs: dict) -> None:
    out, code, output = cli_runs["fails"]
    assert code == 1, f"the run went on without the group: {output}"
    assert "'cpu-broken' cannot start" in output and "--allow-group-loss" in output   # RunFailed's message
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert _start_failures(out, "cpu-broken") == MAX_START_FAILURES
    assert _start_failures(out, "cpu-good") == 0


def test_an_allowed_group_loss_is_reported(cli_runs: dict) -> None:
    out, code, output = cli_runs["allowed"]
    assert code == 3, output
    header = json.loads((out / "run.json").read_text())
    assert header["status"] == "finished" and set(header["lost_groups"]) == {"cpu-broken"}
    log = RunLog.open(out)
    assert log.updates["version"].tolist() == [1]
    lost = log.events[log.events["kind"] == "group_lost"]
    assert list(lost["group"]) == ["cpu-broken"]
    assert json.loads(lost["detail"].iloc[0])["starts_failed"] == MAX_START_FAILURES
    assert _start_failures(out, "cpu-broken") == MAX_START_FAILURES      # given up: no more restarts
    traj = log.trajectories
    assert set(traj[traj["trained_version"] == 1]["group"]) == {"cpu-good"}


def test_mixfleet_run_exit_codes(cli_runs: dict) -> None:
    """`mixfleet run`: 1 and the reason when the group cannot start; 3 and a warning when it was allowed."""
    _, code, output = cli_runs["fails"]
    assert code == 1, output
    assert "the run failed: sampler group 'cpu-broken' cannot start" in output
    _, code, output = cli_runs["allowed"]
    assert code == 3, output
    assert "done: version 1" in output and "'cpu-broken' never started and was left out" in output

