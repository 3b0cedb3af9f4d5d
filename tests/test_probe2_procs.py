"""Issue 24, the second probe: nothing trusted that a file or a page says about processes and paths.

Real processes throughout (a `sleep 60` this test starts stands for "someone else's process"; real `mixfleet run`
and real local Rays for ours), real files, the real Streamlit pages (AppTest) and the real `mixfleet cleanup`.

- A managed.json the app did not write (or one copied from another folder) is not a managed run: the Runs page
  lists no controls for it, shows no driver log from the folder it names, and Stop / Kill / Resume refuse it.
- Even a record the app did write is signalled only while its pid is *this* run's `mixfleet run` process (command
  line with this run's folder, same start time, same user).
- `mixfleet cleanup` stops only Ray's own processes of a dead driver, never what a hand-written record names.
- A plan names model / workload specs by shipped name or as .toml files inside its own folder (uploads: shipped
  only), like `base`.
- A managed run that ended is reaped (no `<defunct>` child of the app).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import tomli_w
from mixfleet.costmodel.errors import SpecError
from mixfleet.policies.plan import load_plan
from mixfleet.ui import run_manager as rm

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "ui" / "app.py")
SECRET = "SECRET-9f3e1c"


@pytest.fixture()
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This test's own state folder (the app's record key, local Ray records)."""
    d = tmp_path / "state"
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(d))
    return d


def _sleeper(env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Someone else's process: a real `sleep 60` in a session (and process group) of its own."""
    return subprocess.Popen(["sleep", "60"], start_new_session=True, env=env)


def _running(proc: subprocess.Popen[bytes]) -> bool:
    """Still running (not exited, not a zombie)."""
    if proc.poll() is not None:
        return False
    try:
        return psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def _plan_text(**over: str) -> str:
    return tomli_w.dumps({**load_plan("tiny-cpu").to_dict(), **over})


def _crafted_record(folder: Path, pid: int, names_folder: Path) -> dict:
    """A managed.json written by hand: another process's pid and real start time, a folder outside the runs
    folder, and launch options nobody chose."""
    rec = {"folder": str(names_folder), "pid": pid, "pid_start": rm._pid_start(pid), "command": ["sleep", "60"],
           "started_utc": "2026-12-01T00:00:00Z", "updates": 3, "resumes": 0,
           "extra": {"init": "/etc", "address": "127.0.0.1:1", "attach": ["g=http://127.0.0.1:9"], "embedded": False}}
    (folder / rm.MANAGED_FILE).write_text(json.dumps(rec))
    return rec


# ---- managed.json ---------------------------------------------------------------------------------------
def test_a_hand_written_managed_json_is_not_a_managed_run(tmp_path: Path, state: Path) -> None:
    """The probe's record: its pid is a live `sleep` with its real start time. Not listed, never signalled, never
    relaunched with its options; even handed over as a ManagedRun, Stop / Kill / Resume refuse it."""
    root = tmp_path / "runs"
    folder = root / "evil"
    (folder / rm.RUN_SUBDIR).mkdir(parents=True)
    (folder / rm.RUN_SUBDIR / "run.json").write_text(json.dumps({"format": "mixfleet-runlog", "status": "stopped"}))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / rm.LOG_FILE).write_text(f"{SECRET} from a driver.log outside the runs folder\n")
    victim = _sleeper()
    try:
        rec = _crafted_record(folder, victim.pid, outside)
        assert rm.load(folder) is None and rm.find(root) == []
        assert "not written by this app" in (rm.refusal(folder) or "")
        m = rm.ManagedRun(**rec)
        assert not m.alive() and m.state() != "running"
        for act in (rm.stop, rm.kill):
            with pytest.raises(rm.RunManagerError, match="not running"):
                act(m)
        with pytest.raises(rm.RunManagerError, match="not a run this app started"):
            rm.resume(m)
        time.sleep(0.3)
        assert _running(victim)
        assert not (folder / rm.LOG_FILE).exists()          # nothing was launched
        assert (outside / rm.LOG_FILE).read_text().count("mixfleet ui:") == 0
    finally:
        _end(victim)


def test_a_record_of_ours_whose_pid_is_another_process_is_not_signalled(tmp_path: Path, state: Path) -> None:
    """The second check: a record this app signed, naming a live process that is not this run's `mixfleet run`
    (pid and start time right, command line not), reads as not running; Stop and Kill refuse it."""
    folder = (tmp_path / "runs" / "stale").resolve()
    (folder / rm.RUN_SUBDIR).mkdir(parents=True)
    victim = _sleeper()
    try:
        m = rm.ManagedRun(folder=str(folder), pid=victim.pid, pid_start=rm._pid_start(victim.pid) or "",
                          command=["whatever"], started_utc="2026-12-01T00:00:00Z", updates=3)
        rm.save(m)
        back = rm.load(folder)
        assert back is not None and back.pid == victim.pid      # the app's own record, in its own folder
        assert not back.alive() and back.state() == "exited"
        for act in (rm.stop, rm.kill):
            with pytest.raises(rm.RunManagerError, match="not running"):
                act(back)
        time.sleep(0.3)
        assert _running(victim)
        # the same process, were it this run's `mixfleet run` (its argv), would be ours: the check is the argv
        assert rm.run_argv(folder)[:4] == [sys.executable, "-m", "mixfleet.ui.cli", "run"]
    finally:
        _end(victim)


def test_a_copied_run_folder_is_not_a_managed_run_and_the_page_settles(tmp_path: Path, state: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`runs/backup/<run>` (a copy of a managed run folder whose run log exists): the copy's record names the
    original folder, so it is refused; the Runs page on the backup folder renders once (it reran itself forever)."""
    pytest.importorskip("streamlit.testing.v1")
    from mixfleet.costmodel.records.runlog import RunLogWriter
    from streamlit.testing.v1 import AppTest

    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    original = (runs / "r").resolve()
    with RunLogWriter(original / rm.RUN_SUBDIR, {"source": "runner", "plan": load_plan("tiny-cpu").to_dict(),
                                                 "seed": 0}) as w:
        w.flush()
    gone = subprocess.Popen(["true"])
    gone.wait()
    rm.save(rm.ManagedRun(folder=str(original), pid=gone.pid, pid_start="1", command=[],
                          started_utc="2026-12-01T00:00:00Z", updates=3))
    shutil.copytree(original, runs / "backup" / "r")
    assert rm.load(original) is not None
    assert rm.load(runs / "backup" / "r") is None and rm.find(runs / "backup") == []
    assert "copied" in (rm.refusal(runs / "backup" / "r") or "")
    at = AppTest.from_file(APP, default_timeout=90)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    t0 = time.monotonic()
    at.text_input[0].set_value(str(runs / "backup")).run()
    assert not at.exception, [e.value for e in at.exception]
    assert time.monotonic() - t0 < 60
    assert not [b for b in at.button if b.label.startswith(("Stop", "Kill", "Resume"))]


def test_the_runs_page_never_offers_controls_or_foreign_logs_for_a_crafted_record(
        tmp_path: Path, state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe on the page: a run log with a hand-written managed.json beside it (a live `sleep`'s pid and start
    time, `folder` outside the runs folder). No Stop / Kill / Resume, no tail of the outside driver.log, the page
    says the record is not the app's, and the `sleep` lives."""
    pytest.importorskip("streamlit.testing.v1")
    from mixfleet.costmodel.records.runlog import RunLogWriter
    from streamlit.testing.v1 import AppTest

    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    folder = runs / "evil"
    w = RunLogWriter(folder / rm.RUN_SUBDIR, {"source": "runner", "plan": load_plan("tiny-cpu").to_dict(), "seed": 0})
    w.flush()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / rm.LOG_FILE).write_text(f"{SECRET} from a driver.log outside the runs folder\n")
    victim = _sleeper()
    try:
        _crafted_record(folder, victim.pid, outside)
        at = AppTest.from_file(APP, default_timeout=240)
        at.run()
        at.switch_page("app_runs.py")
        at.run()
        at.selectbox(key="runs_pick").set_value(str(folder / rm.RUN_SUBDIR)).run()
        assert not at.exception, [e.value for e in at.exception]
        assert not [b for b in at.button if b.label.startswith(("Stop", "Kill", "Resume", "Continue"))]
        shown = [str(e.value) for kind in ("markdown", "caption", "info", "warning", "error", "code", "text")
                 for e in at.get(kind)]
        assert not [s for s in shown if SECRET in s]
        assert any("not written by this app" in s for s in shown), shown
        assert _running(victim)
    finally:
        _end(victim)
        w.close()


# ---- managed runs of ours ------------------------------------------------------------------------------
def test_our_own_run_is_still_stopped_and_then_reaped(tmp_path: Path, state: Path) -> None:
    """A real `mixfleet run` the app started: its record is ours, Stop signals it, and once it has exited it is
    reaped (it stayed a `<defunct>` child of the app)."""
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model

    init = init_model(load_model_spec("tiny"), tmp_path / "init", seed=0)
    root = tmp_path / "runs"
    m = rm.start(root, "ours", _plan_text(), 2, init=str(init))
    try:
        back = rm.load(root / "ours")
        assert back is not None and back.alive() and back.state() == "running"
        assert rm.refusal(root / "ours") is None
        import dataclasses

        assert not dataclasses.replace(back, pid_start="1").alive()        # a reused pid: another start time
        assert not dataclasses.replace(back, folder=str(tmp_path)).alive()  # the process is another folder's run
        rm.stop(back)
        deadline = time.monotonic() + 120
        while Path(f"/proc/{m.pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(f"/proc/{m.pid}").exists(), f"pid {m.pid} left behind: " + \
            Path(f"/proc/{m.pid}/stat").read_text()
        assert rm.load(root / "ours").state() in ("stopped", "exited", "failed")
    finally:
        if Path(f"/proc/{m.pid}").exists():
            os.killpg(m.pid, signal.SIGKILL)


# ---- mixfleet cleanup ----------------------------------------------------------------------------------
def test_cleanup_never_stops_what_a_hand_written_record_names(tmp_path: Path, state: Path) -> None:
    """The probe's record: a dead "driver", an unrelated `sleep` by pid and start time, and another `sleep`
    carrying the record's token in its environment. `mixfleet cleanup` stops neither and drops the record."""
    from mixfleet.runner.orchestration.local_ray import TOKEN_ENV
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    token = uuid.uuid4().hex
    recorded = _sleeper()
    marked = _sleeper(env={**os.environ, TOKEN_ENV: token})
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        rec = {"driver": {"pid": gone.pid, "create_time": 1.0, "name": "python3"}, "token": token,
               "started_utc": time.time(),
               "processes": [{"pid": recorded.pid, "create_time": psutil.Process(recorded.pid).create_time(),
                              "name": "sleep"}]}
        (state / "ray").mkdir(parents=True)
        path = state / "ray" / f"{gone.pid}-{token[:12]}.json"
        path.write_text(json.dumps(rec))
        res = CliRunner().invoke(app, ["cleanup"])
        assert res.exit_code == 0, res.output
        assert "0 leftover Ray process(es) stopped" in res.output, res.output
        time.sleep(0.3)
        assert _running(recorded) and _running(marked)
        assert not path.exists()
    finally:
        _end(recorded, marked)


RAY_CHILD = """
import sys, time
from mixfleet.runner.orchestration.actors import init_ray
init_ray(num_cpus=1)
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_cleanup_still_stops_a_killed_drivers_ray(tmp_path: Path, state: Path) -> None:
    """The other side: a real local Ray whose driver was killed with kill -9 is stopped by `mixfleet cleanup`
    (its agents outlive the driver), while a hand-written record's `sleep` next to it lives."""
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    child = subprocess.Popen([sys.executable, "-c", RAY_CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    victim = _sleeper()
    procs: list[psutil.Process] = []
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line or line.startswith("READY"):
                break
            lines.append(line)
        assert line.startswith("READY"), "".join(lines[-20:])
        time.sleep(2.0)
        procs = psutil.Process(child.pid).children(recursive=True)
        assert {"gcs_server", "raylet"} <= {p.name() for p in procs}
        gone = subprocess.Popen(["true"])
        gone.wait()
        (state / "ray" / f"{gone.pid}-crafted.json").write_text(json.dumps(
            {"driver": {"pid": gone.pid, "create_time": 1.0}, "token": uuid.uuid4().hex,
             "processes": [{"pid": victim.pid, "create_time": psutil.Process(victim.pid).create_time()}]}))
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        time.sleep(3.0)
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert left, "nothing outlived the driver: this test would not show cleanup at work"
        res = CliRunner().invoke(app, ["cleanup"])
        assert res.exit_code == 0, res.output
        still = [p.name() for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert still == [], (still, res.output)
        assert _running(victim)
        assert list((state / "ray").glob("*.json")) == []
    finally:
        for p in procs:
            try:
                if p.is_running():
                    p.kill()
            except psutil.Error:
                pass
        _end(victim)
        if child.poll() is None:
            child.kill()


# ---- paths a plan names --------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["model", "workload"])
def test_an_uploaded_plan_cannot_read_a_toml_file_elsewhere(tmp_path: Path, field: str) -> None:
    from mixfleet.ui.app_common import plan_from_upload

    secret = tmp_path / "secret.toml"
    secret.write_text(f'api_key = "{SECRET}"\n')
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "link.toml").symlink_to(secret)
    for ref in (str(secret), "../secret.toml", "link.toml"):
        with pytest.raises(SpecError) as e:
            plan_from_upload(_plan_text(**{field: ref}).encode())
        msg = str(e.value)
        assert f"field '{field}'" in msg and ref in msg and "shipped" in msg and SECRET not in msg, msg
    # the same rule for a plan file on disk: a link out of its folder is refused, a spec beside it is fine
    (tmp_path / "up" / "plan.toml").write_text(_plan_text(**{field: "link.toml"}))
    with pytest.raises(SpecError, match=f"field '{field}'"):
        load_plan(tmp_path / "up" / "plan.toml")
    shipped = load_plan("tiny-cpu")
    spec_name = "tiny" if field == "model" else "tiny-cpu"
    folder = "models" if field == "model" else "workloads"
    from mixfleet.costmodel.paths import data_path

    (tmp_path / "up" / "mine.toml").write_text(data_path(folder, f"{spec_name}.toml").read_text())
    (tmp_path / "up" / "plan.toml").write_text(_plan_text(**{field: "mine.toml"}))
    plan = load_plan(tmp_path / "up" / "plan.toml")
    assert getattr(plan, field) == str((tmp_path / "up" / "mine.toml").resolve())   # beside it, wherever the CWD
    assert getattr(shipped, field) == spec_name                                     # shipped names stay names


def test_the_dry_run_page_does_not_show_an_outside_tomls_values(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe on the page: an uploaded plan with `model = "/abs/secret.toml"`; the page names the field and what
    is allowed, and no value of the secret file appears, before or after Simulate."""
    pytest.importorskip("streamlit.testing.v1")
    from streamlit.testing.v1 import AppTest

    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_UI_UPDATES", "1")
    monkeypatch.setenv("MIXFLEET_UI_WORKLOAD", "tiny-cpu")
    secret = tmp_path / "secret.toml"
    secret.write_text(f'name = "{SECRET}"\napi_key = "{SECRET}"\n')
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_dryrun.py")
    at.run()
    at.radio(key="a_src").set_value("Upload a plan TOML")
    at.toggle(key="dr_two").set_value(False)
    at.run()
    at.file_uploader(key="a_upload").set_value(("plan.toml", _plan_text(model=str(secret)).encode(),
                                                "application/octet-stream"))
    at.run()
    for b in at.button:
        if b.key == "dr_go" and not b.disabled:
            b.click().run()
            break
    assert not at.exception, [e.value for e in at.exception]
    shown = [str(e.value) for kind in ("markdown", "caption", "info", "warning", "error", "code", "text")
             for e in at.get(kind)]
    assert not [s for s in shown if SECRET in s], [s for s in shown if SECRET in s]
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "field 'model'" in errors[0] and "shipped" in errors[0], errors


def test_run_for_real_makes_the_run_folder_self_contained(tmp_path: Path, state: Path) -> None:
    """A Plan-page plan names its edited spec under RUNS/ui-specs/; a managed run copies it beside its plan.toml,
    so `mixfleet run` (which only reads specs beside the plan) runs it. A spec outside the runs folder is refused
    before anything starts."""
    from mixfleet.costmodel.paths import data_path

    root = (tmp_path / "runs").resolve()
    (root / "ui-specs").mkdir(parents=True)
    spec = root / "ui-specs" / "workload-tiny-cpu-0123456789.toml"
    spec.write_text(data_path("workloads", "tiny-cpu.toml").read_text())
    folder = root / "edited"
    folder.mkdir()
    text = rm.self_contained_plan(_plan_text(workload=str(spec)), root, folder)
    assert (folder / "workload.toml").read_text() == spec.read_text()
    (folder / rm.PLAN_FILE).write_text(text)
    assert load_plan(folder / rm.PLAN_FILE).workload == str(folder / "workload.toml")
    secret = tmp_path / "secret.toml"
    secret.write_text(f'api_key = "{SECRET}"\n')
    with pytest.raises(SpecError) as e:
        rm.start(root, "outside", _plan_text(model=str(secret)), 2)
    assert "field 'model'" in str(e.value) and SECRET not in str(e.value)
    assert not (root / "outside").exists()
