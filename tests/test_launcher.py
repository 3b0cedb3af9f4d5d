"""One launcher for a real run (runner/orchestration/launcher.py, issue 25 item 2): the CLI, the app's managed
runs and the studies start, stop and resume a run through it.

Fast: the fleet mode of a plan, the child's command line (the app's `run_argv` is its prefix), SIGTERM asking a
run to stop, a child and its whole process group killed (and a process that does not lead its group refused),
a study's run that outlives its time-out killed through it. Slow (a real run): `mixfleet run` started as a
child, stopped with SIGTERM after its first update (log "stopped", resumable), resumed to its target with each
update once; a SIGTERM inside Ray's start-up closes the log "stopped"; Ray's own SIGTERM handler, installed by
`ray.init`, is handed back to the launcher's by `actors.init_ray` (main re-took it on every event of the run).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.policies.plan import load_plan
from mixfleet.runner.orchestration import launcher
from mixfleet.studies.runs import StudyRun, StudySettings, merge_manifest, run_study
from mixfleet.ui import run_manager
from runplans import CPU_BF16, run_files, run_plan_toml


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_the_fleet_mode_of_a_plan() -> None:
    cpu, gpu = load_plan("tiny-cpu"), load_plan("seed-mixed")
    assert launcher.fleet_mode(cpu) == "embedded"
    assert launcher.fleet_mode(gpu, embedded=True) == "embedded"
    assert launcher.fleet_mode(gpu, address="10.0.0.1:6379") == "sglang"
    assert launcher.fleet_mode(gpu, attach={gpu.groups[0].name: ["http://127.0.0.1:1"]}) == "attach"
    with pytest.raises(SpecError, match="pass --embedded to rehearse this plan locally, --address"):
        launcher.fleet_mode(gpu)


def test_the_childs_command_line_is_the_apps(tmp_path: Path) -> None:
    argv = launcher.run_argv(tmp_path / "plan.toml", tmp_path / "run", updates=5, resume=True, init="/ckpt",
                             attach=["g=http://h:1"], embedded=True)
    assert argv == [sys.executable, "-m", "mixfleet.ui.cli", "run", str(tmp_path / "plan.toml"), "--out",
                    str(tmp_path / "run"), "--updates", "5", "--quiet", "--resume", "--init", "/ckpt", "--attach",
                    "g=http://h:1", "--embedded"]
    assert argv[:7] == run_manager.run_argv(tmp_path)          # what the app looks for in /proc


def test_sigterm_asks_the_run_to_stop_after_its_update() -> None:
    class Run:                        # what the handler sets: the orchestrator's stop flag, read at each update
        stop_requested = False

    said: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    with launcher.StopOnSigterm(said.append) as stop:
        run = Run()
        stop.attach(run)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.asked and run.stop_requested and said == [launcher.STOP_MESSAGE]
        late = Run()
        stop.attach(late)                  # asked before the run was there: it stops at its first update
        assert late.stop_requested
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_child_is_killed_with_its_process_group(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    proc = launcher.start_child(["sh", "-c", "sleep 60 & echo started $!; wait"], log_path=log, banner="[t] begin")
    for _ in range(200):
        if "started" in log.read_text():
            break
        time.sleep(0.02)
    grandchild = int(log.read_text().split("started")[1].split()[0])
    assert os.getpgid(proc.pid) == proc.pid and os.getpgid(grandchild) == proc.pid
    launcher.kill_child(proc.pid)
    proc.wait(10)
    assert _wait_gone([proc.pid, grandchild]), "the child's group outlived kill_child"
    assert log.read_text().startswith("\n[t] begin\n")
    plain = subprocess.Popen(["sleep", "60"])                  # not started by the launcher: in our group
    try:
        with pytest.raises(RuntimeError, match=f"pid {plain.pid} does not lead its own process group"):
            launcher.kill_child(plain.pid)
    finally:
        plain.kill()
        plain.wait()
    launcher.kill_child(proc.pid)                               # gone already: no error


def test_a_study_run_past_its_time_out_is_killed_through_the_launcher(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # a child module of the study's protocol (`-m MODULE --child JOB`) that never finishes, with a child of its own
    (tmp_path / "hang_child.py").write_text(
        "import subprocess, sys, time\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        "print('grandchild', p.pid, flush=True)\n"
        "time.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = StudyRun(name="hang", out_dir=tmp_path / "hang", plan="tiny-cpu", run={"updates": 1})
    manifest = run_study([run], manifest_path=tmp_path / "study.json", manifest_extra={}, base_policy="/none",
                         settings=StudySettings(run_timeout_s=2.0, start_gap_s=0.0, retries=0), log=lambda _: None,
                         child_module="hang_child")
    entry = manifest["runs"]["hang"]
    assert entry["status"] == "timeout" and entry["exit_code"] == -signal.SIGKILL
    grandchild = int((tmp_path / "hang" / "driver.log").read_text().split("grandchild")[1].split()[0])
    assert _wait_gone([grandchild]), "the study's run left a process of its group behind"
    assert json.loads((tmp_path / "study.json").read_text())["runs"]["hang"]["status"] == "timeout"


_STUDY_DRIVER = """
import sys
from pathlib import Path
from mixfleet.studies.runs import StudyRun, StudySettings, merge_manifest, run_study
tmp, grace = Path(sys.argv[1]), float(sys.argv[2])
run = StudyRun(name="r", out_dir=tmp / "r", plan="tiny-cpu", run={"updates": 1})
run_study([run], manifest_path=tmp / "study.json", manifest_extra={}, base_policy="/none",
          settings=StudySettings(start_gap_s=0.0, retries=0, stop_grace_s=grace), log=print,
          child_module="study_child")
"""

# a child of the study's protocol with a process of its own group (a run's Ray): on SIGTERM it says so and exits
# 0 (a run stopping after its update), or, with IGNORE set, goes on (a run stuck in its update)
_STUDY_CHILD = """
import os, signal, subprocess, sys, time
p = subprocess.Popen(["sleep", "120"])
def term(*_):
    print("child got SIGTERM", flush=True)
    if not os.environ.get("IGNORE"):
        p.kill()
        sys.exit(0)
signal.signal(signal.SIGTERM, term)
print("grandchild", p.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("ignores", [False, True], ids=["stops", "stuck"])
def test_a_signalled_study_stops_its_runs_instead_of_leaving_them_behind(tmp_path: Path, ignores: bool) -> None:
    # Regression: a run leads its own process group, so SIGTERM (or a terminal's Ctrl-C) to the study driver
    # ended the driver alone; the run went on, unwatched, with "running" and its pid left in the manifest.
    (tmp_path / "study_child.py").write_text(_STUDY_CHILD)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               IGNORE="1" if ignores else "")
    driver = subprocess.Popen([sys.executable, "-c", _STUDY_DRIVER, str(tmp_path), "1.5"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "r" / "driver.log"
    deadline = time.monotonic() + 60
    while not (log.exists() and "grandchild" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log.exists() and "grandchild" in log.read_text(), driver.communicate(timeout=10)[0]
    child = json.loads((tmp_path / "study.json").read_text())["runs"]["r"]["pid"]
    grandchild = int(log.read_text().split("grandchild")[1].split()[0])
    driver.send_signal(signal.SIGTERM)
    out = driver.communicate(timeout=60)[0]
    assert driver.returncode == 128 + signal.SIGTERM, out
    assert "child got SIGTERM" in log.read_text(), "the run was not asked to stop after its update"
    assert _wait_gone([child, grandchild]), f"the study left its run behind: {out}"
    assert "continue it with --resume" in out
    assert ("killed r" in out) == ignores, out
    entry = json.loads((tmp_path / "study.json").read_text())["runs"]["r"]
    assert entry["status"] == "interrupted" and "pid" not in entry
    assert entry["exit_code"] == (-signal.SIGKILL if ignores else 0)


def test_a_study_run_in_two_calls_keeps_both_calls_description(tmp_path: Path) -> None:
    # Regression: the MoE ablation ran its two fleets in two calls into one folder (as its docs say to), and the
    # second call's description replaced the first's: the report's Setup named only the replay fleet's plan.
    def call(fleet: str, runs: list[str]) -> dict:
        study = [StudyRun(name=n, out_dir=tmp_path / n, plan="tiny-cpu") for n in runs]
        extra = {"plans": {fleet: f"plan-{fleet}"}, "config": {"fleets": [fleet], "updates": 30, "lr": 1.5e-4},
                 "rungs": runs}
        return run_study(study, manifest_path=tmp_path / "study.json", manifest_extra=extra, base_policy="/b",
                         settings=StudySettings(), log=lambda _: None, states=dict.fromkeys(runs, "finished"))

    call("mixed-moe", ["m/grpo", "m/sc"])
    second = call("mixed-moe-replay", ["r/sc"])
    assert second == json.loads((tmp_path / "study.json").read_text())
    assert second["plans"] == {"mixed-moe": "plan-mixed-moe", "mixed-moe-replay": "plan-mixed-moe-replay"}
    assert second["config"] == {"fleets": ["mixed-moe", "mixed-moe-replay"], "updates": 30, "lr": 1.5e-4}
    assert second["rungs"] == ["m/grpo", "m/sc", "r/sc"] and set(second["runs"]) == {"m/grpo", "m/sc", "r/sc"}
    assert merge_manifest({"lr": 3e-4, "t": {"a": 1}}, {"lr": 1e-4, "t": {"b": 2}}) == {"lr": 1e-4,
                                                                                        "t": {"a": 1, "b": 2}}


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_and_resumed_through_the_launcher(tmp_path: Path) -> None:
    plan_toml = run_plan_toml("launcher-test", [CPU_BF16], embedded={"max_turns": 2, "max_new_tokens": 8},
                              batcher={"prompts_per_update": 2, "samples_per_prompt": 2, "inflight_prompts": 4,
                                       "max_staleness": 0, "stale": "wait"})
    init, plan_path = run_files(tmp_path, plan_toml)
    out, log = tmp_path / "run", tmp_path / "driver.log"
    argv = launcher.run_argv(plan_path, out, updates=3, init=str(init)) + ["--eval-every", "0"]
    proc = launcher.start_child(argv, log_path=log)
    try:
        deadline = time.monotonic() + 300
        while "update 1/3" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "update 1/3" in log.read_text(), log.read_text()[-2000:]
        launcher.stop_child(proc.pid)
        assert proc.wait(300) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            launcher.kill_child(proc.pid)
    text = log.read_text()
    assert launcher.STOP_MESSAGE in text and "stopped: version" in text, text[-2000:]
    first = RunLog.open(out)
    assert first.header["status"] == "stopped" and 1 <= int(first.updates["version"].max()) < 3
    proc = launcher.start_child(launcher.run_argv(plan_path, out, updates=3, init=str(init), resume=True)
                                + ["--eval-every", "0"], log_path=log)
    try:
        assert proc.wait(300) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            launcher.kill_child(proc.pid)
    done = RunLog.open(out)
    assert done.header["status"] == "finished" and done.header["resumes"] == 1
    assert sorted(done.updates["version"].tolist()) == [1, 2, 3]              # each update once


def test_a_sigterm_in_rays_start_up_closes_the_log_stopped(tmp_path: Path, state: Path) -> None:
    """Issue 44 (third probe): a SIGTERM during Ray's start-up left run.json "running" (Ray's own handler, installed
    inside `ray.init`, exits at once). The signal is sent once the run's local Ray has its raylet up (ray.init is
    then connecting the driver, Ray's handler in place): the log must read "stopped" (resumable), never "running"."""
    from mixfleet.runner.orchestration.local_ray import stop_leftover_rays

    plan_toml = run_plan_toml("launcher-sigterm", [CPU_BF16], embedded={"max_turns": 2, "max_new_tokens": 8},
                              batcher={"prompts_per_update": 2, "samples_per_prompt": 2, "inflight_prompts": 4,
                                       "max_staleness": 0, "stale": "wait"})
    init, plan_path = run_files(tmp_path, plan_toml)
    out, log = tmp_path / "run", tmp_path / "driver.log"
    proc = launcher.start_child(launcher.run_argv(plan_path, out, updates=3, init=str(init)) + ["--eval-every", "0"],
                                log_path=log)
    try:
        deadline = time.monotonic() + 300
        while not _raylet_of(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (out / "run.json").exists() and _raylet_of(proc.pid), log.read_text()[-2000:]
        launcher.stop_child(proc.pid)            # Ray's raylet is up: ray.init is connecting the driver
        proc.wait(300)
    finally:
        if proc.poll() is None:
            launcher.kill_child(proc.pid)
        stop_leftover_rays()
    header = json.loads((out / "run.json").read_text())
    assert header["status"] == "stopped", (header["status"], log.read_text()[-2000:])
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def _raylet_of(pid: int) -> bool:
    """A raylet among the descendants of `pid` (the local Ray a run's `ray.init` starts)."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return False
    for k in kids:
        try:
            if any("raylet" in a for a in k.cmdline()[:2]):
                return True
        except psutil.Error:
            continue
    return False
