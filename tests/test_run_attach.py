"""Issue 24 (the second probe): attach mode follows the group-start rule, and loads the run's weights first.

Real runs (tiny model, Ray, the Megatron-core trainer) attached to real servers over HTTP on 127.0.0.1: group
`cpu-bf16` is attached to `http://127.0.0.1:9`, where nothing listens (the probe's URL), and `cpu-fp8` to a live
embedded server that still holds another run's weights (seed 1, weight version "7"). Two runs through
`mixfleet run --attach`, shared by the tests: one without and one with `--allow-group-loss`.

On main the dead URL was logged "ready" without a probe and crash-looped, the run ended "done" with exit 0 and
`lost_groups {}` (`--allow-group-loss` changed nothing), and the live server was sampled on the other run's
weights (staleness -1.00 at update 1, a KL 100x higher). Now the attach checks are a start: 3 failed in a row
fail the run (`RunFailed`, exit 1) or, allowed, lose the group (exit 3); a server is "ready" only after it loaded
the run's weights.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.runner.orchestration.sampler_fleet import MAX_START_FAILURES
from runplans import CPU_BF16, CPU_FP8, FIXED_EVERY_1S, run_files, run_plan_toml
from sampler_helpers import make_checkpoint

pytestmark = pytest.mark.slow

DEAD = "http://127.0.0.1:9"
PLAN = run_plan_toml(
    "attach-probe-test", [CPU_BF16, CPU_FP8], trainer={"loss": "sc_mis"}, autoscaler=FIXED_EVERY_1S,
    batcher={"prompts_per_update": 2, "samples_per_prompt": 2, "inflight_prompts": 4},
    embedded={"max_turns": 2, "max_new_tokens": 8})


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    from mixfleet.runner.sampler.engine import Engine
    from mixfleet.runner.sampler.server import ServerArgs
    from mixfleet.runner.sampler.server_launch import start_in_thread

    with socket.socket() as s:                                   # the probe's URL: nothing listens on port 9
        assert s.connect_ex(("127.0.0.1", 9)) != 0, "something listens on 127.0.0.1:9; this test needs it dead"
    root = tmp_path_factory.mktemp("attach-probe")
    init, plan_path = run_files(root, PLAN)
    other = make_checkpoint(root / "other-run", seed=1, weight_version="7")   # another run's weights
    engine = Engine(other, precision="fp8", kv_cache_dtype="fp8_e4m3", max_running_requests=16)
    handle = start_in_thread(engine, server_args=ServerArgs(port=0))
    try:
        yield {"root": root, "init": str(init), "plan_path": plan_path,
               "engine": engine, "other": other, "url": handle.url}
    finally:
        handle.stop()


def _events(out: Path, kind: str, group: str):  # noqa: ANN202
    ev = RunLog.open(out).events
    return ev[(ev["kind"] == kind) & (ev["group"] == group)]


def _serve_other_runs_weights(setup: dict) -> None:
    """The live server back on the other run's checkpoint (an earlier test's run left its own weights there)."""
    r = httpx.post(setup["url"] + "/update_weights_from_disk", json={"model_path": str(setup["other"]),
                   "weight_version": "7"}, timeout=120, trust_env=False)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert str(setup["engine"].weight_version) == "7"


@pytest.fixture(scope="module")
def cli_runs(setup: dict) -> dict[str, tuple[Path, int, str]]:
    """The two runs every test here reads, each started once through `mixfleet run --attach` (the CLI calls
    `run_plan`): "fails" (the dead URL), then, with the live server back on the other run's weights, "allowed"
    (--allow-group-loss); name -> (run folder, exit code, output). Before issue 43 each test started its own
    runs (4 runs for 2 cases)."""
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    base = ["run", str(setup["plan_path"]), "--updates", "1", "--init", setup["init"], "--eval-every", "0",
            "--quiet", "--attach", f"cpu-bf16={DEAD}", "--attach", f"cpu-fp8={setup['url']}"]
    runs = {}
    for name, extra in (("fails", []), ("allowed", ["--allow-group-loss"])):
        if name == "allowed":
            _serve_other_runs_weights(setup)
        out = setup["root"] / name
        r = CliRunner().invoke(app, [*base, "--out", str(out), *extra])
        print(f"\n{name}:", r.output[-600:])
        runs[name] = (out, r.exit_code, r.output)
    runs["weight_version_after"] = str(setup["engine"].weight_version)   # what the allowed run left it serving
    return runs


def test_a_dead_attach_url_fails_the_run(cli_runs: dict) -> None:
    out, code, output = cli_runs["fails"]
    assert code == 1, f"the run went on without the group: {output}"
    assert "'cpu-bf16' cannot start" in output and "nothing listens there" in output \
        and "--allow-group-loss" in output                               # RunFailed's message
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    crashes = _events(out, "crash", "cpu-bf16")
    assert list(crashes["detail"].str.startswith("start failed: AttachFailed: http://127.0.0.1:9: nothing listens")) \
        == [True] * MAX_START_FAILURES
    assert _events(out, "ready", "cpu-bf16").empty                   # on main: "ready", without a probe
    assert len(_events(out, "ready", "cpu-fp8")) == 1


def test_an_allowed_dead_attach_url_is_a_lost_group(cli_runs: dict) -> None:
    out, code, output = cli_runs["allowed"]
    assert code == 3, output                                              # on main: 0
    header = json.loads((out / "run.json").read_text())
    assert header["status"] == "finished" and set(header["lost_groups"]) == {"cpu-bf16"}    # on main: {}
    assert RunLog.open(out).updates["version"].tolist() == [1]
    lost = _events(out, "group_lost", "cpu-bf16")
    assert len(lost) == 1 and json.loads(lost["detail"].iloc[0])["starts_failed"] == MAX_START_FAILURES
    assert len(_events(out, "crash", "cpu-bf16")) == MAX_START_FAILURES     # given up: no crash loop
    traj = RunLog.open(out).trajectories
    assert set(traj[traj["trained_version"] == 1]["group"]) == {"cpu-fp8"}


def test_an_attached_server_holding_another_runs_weights_loads_the_runs_first(setup: dict, cli_runs: dict) -> None:
    out, code, output = cli_runs["allowed"]
    assert code == 3, output
    placed = _events(out, "placed", "cpu-fp8")
    assert len(placed) == 1
    detail = json.loads(placed["detail"].iloc[0])
    assert detail["attached"]["held_weight_version"] == "7"              # what it served before the run
    assert detail["attached"]["held_model_path"].endswith("other-run")
    assert detail["model_path"] == setup["init"] and detail["url"] == setup["url"]
    log = RunLog.open(out)
    traj = log.trajectories
    first = traj[traj["trained_version"] == 1]
    assert len(first) and (first["version_start"] == 0).all() and (first["version_end"] == 0).all()
    upd = log.updates
    u1 = upd[upd["version"] == 1].iloc[0]
    print("\nupdate 1: staleness mean", u1["staleness_mean"], "k3", u1.get("kl_k3"))
    assert u1["staleness_mean"] == 0.0                                      # on main: -1.00 (sampled by v"7")
    on_policy = log.header["on_policy_kl_by_group"]["cpu-fp8"]             # the run's summary, as run.json has it
    print("on-policy KL of cpu-fp8:", on_policy)
    assert on_policy["tokens"] > 0 and on_policy["k3"] < 0.1                # on main: k3 10.4 (another run's policy)
    assert cli_runs["weight_version_after"] == "1"                          # and it was pushed the run's update


def test_mixfleet_run_exit_codes_with_a_dead_attach_url(cli_runs: dict) -> None:
    """`mixfleet run --attach`: 1 and the reason when the group cannot start; 3 when it was allowed."""
    _, code, output = cli_runs["fails"]
    assert code == 1, output
    assert "the run failed: sampler group 'cpu-bf16' cannot start" in output
    _, code, output = cli_runs["allowed"]
    assert code == 3, output                                              # on main: 0 either way
    assert "done: version 1" in output and "'cpu-bf16' never started and was left out" in output
