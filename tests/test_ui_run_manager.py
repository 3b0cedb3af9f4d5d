"""The app's managed runs (ui/run_manager.py) and their Runs-page controls, for real: `mixfleet run` started
as a background process of its own, found again from its folder after the app's state is gone, refused where
it would start twice or overwrite something, killed (SIGKILL to its process group) with the run log left
readable. The full loop (start -> stop -> resume -> calibrate -> re-plan) is the browser test's
(tests/test_ui_browser.py); a stop and resume with each update exactly once is checked there with pandas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
from mixfleet.costmodel.errors import SpecError
from mixfleet.policies.plan import load_plan
from mixfleet.ui import run_manager as rm


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            rest = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if rest[0] != "Z" and int(rest[2]) == pgid:
            out.append(int(stat.parent.name))
    return out


def _plan_text() -> str:
    return tomli_w.dumps(load_plan("tiny-cpu").to_dict())


def test_names_stay_one_folder_inside_the_runs_root(tmp_path: Path) -> None:
    for bad in ("", "../x", "a/b", "/etc", ".hidden", "x" * 65, "a b"):
        with pytest.raises(rm.RunManagerError, match="run name"):
            rm.run_folder(tmp_path, bad)
    assert rm.run_folder(tmp_path, "ok-1.2_3") == (tmp_path / "ok-1.2_3").resolve()


def test_a_plan_is_data_only(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="base"):
        rm.parse_plan('base = "/etc/some.toml"\nname = "x"\n')
    with pytest.raises(SpecError, match="not TOML"):
        rm.parse_plan("this is [not toml")
    assert rm.parse_plan(_plan_text()).name == "tiny-cpu"


def test_refuses_a_folder_that_holds_anything(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(rm.RunManagerError, match="not empty"):
        rm.start(tmp_path, "mine", _plan_text(), 2)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "mine" / rm.MANAGED_FILE).exists()
    with pytest.raises(rm.RunManagerError, match="updates"):
        rm.start(tmp_path, "new", _plan_text(), 0)


def test_a_reused_pid_is_not_taken_for_the_run(tmp_path: Path) -> None:
    """A record whose pid now belongs to another process (other start time) reads as not alive."""
    me = rm.ManagedRun(folder=str(tmp_path), pid=os.getpid(), pid_start=rm._pid_start(os.getpid()) or "",
                       command=[], started_utc="", updates=1)
    assert me.alive()
    other = rm.ManagedRun(folder=str(tmp_path), pid=os.getpid(), pid_start="1", command=[], started_utc="",
                          updates=1)
    assert not other.alive()
    with pytest.raises(rm.RunManagerError, match="not running"):
        rm.kill(other)                    # never signals a process that is not the run's


@pytest.mark.slow
def test_start_find_refuse_twice_kill(tmp_path: Path) -> None:
    """A real `mixfleet run` in the background: found from its folder alone, a second start there refused,
    killed with its process group, the state read back from disk as 'killed' and resumable."""
    from mixfleet.costmodel.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model

    init = init_model(load_model_spec("tiny"), tmp_path / "init", seed=0)
    root = tmp_path / "runs"
    m = rm.start(root, "r1", _plan_text(), 2, init=str(init))
    try:
        assert m.alive() and m.state() == "running"
        again = rm.find(root)                 # what an app restarted later sees
        assert [x.name for x in again] == ["r1"] and again[0].pid == m.pid and again[0].alive()
        with pytest.raises(rm.RunManagerError, match="running"):
            rm.start(root, "r1", _plan_text(), 2, init=str(init))
        with pytest.raises(rm.RunManagerError, match="running"):
            rm.resume(again[0])
        deadline = time.monotonic() + 600    # wait for its run log (Ray and the samplers start first)
        while not (m.run_dir / "run.json").exists() and time.monotonic() < deadline:
            assert m.alive(), m.log_tail()
            time.sleep(0.5)
        rm.kill(again[0])
        assert not m.alive()
        back = rm.load(root / "r1")
        assert back is not None and back.state() == "killed"
        assert json.loads((m.run_dir / "run.json").read_text())["format"] == "mixfleet-runlog"
        # nothing of the run's process group is left (its local Ray included; zombies wait for their reaper)
        deadline = time.monotonic() + 30
        while _group_members(m.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _group_members(m.pid) == []
    finally:
        if m.alive():
            os.killpg(m.pid, 9)


def test_the_runs_page_offers_controls_only_for_its_own_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run log the app did not start has no Stop/Kill/Resume; one it started (a managed.json naming a live
    process of its own) does. The managed process here is a real child that we end ourselves."""
    pytest.importorskip("streamlit.testing.v1")
    from mixfleet.costmodel.runlog import RunLogWriter
    from streamlit.testing.v1 import AppTest

    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    plan = load_plan("tiny-cpu")
    with RunLogWriter(runs / "foreign", {"source": "runner", "plan": plan.to_dict(), "seed": 0}) as w:
        w.flush()
    folder = runs / "mine"
    (folder / rm.RUN_SUBDIR).mkdir(parents=True)
    w = RunLogWriter(folder / rm.RUN_SUBDIR, {"source": "runner", "plan": plan.to_dict(), "seed": 0})
    w.flush()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        rec = rm.ManagedRun(folder=str(folder), pid=child.pid, pid_start=rm._pid_start(child.pid) or "",
                            command=["test"], started_utc="2026-12-01T00:00:00Z", updates=3)
        (folder / rm.MANAGED_FILE).write_text(json.dumps(rec.__dict__))
        app = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")
        at = AppTest.from_file(app, default_timeout=240)
        at.run()
        at.switch_page("app_runs.py")
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        at.selectbox(key="runs_pick").set_value(str(runs / "foreign")).run()
        assert not [b for b in at.button if b.label.startswith(("Stop", "Kill", "Resume"))]
        at.selectbox(key="runs_pick").set_value(str(folder / rm.RUN_SUBDIR)).run()
        assert not at.exception, [e.value for e in at.exception]
        labels = [b.label for b in at.button]
        assert "Stop (after this update)" in labels and "Kill now" in labels
        kill = next(b for b in at.button if b.label == "Kill now")
        kill.click().run()
        child.wait(timeout=30)
        assert child.returncode == -9
        assert rm.load(folder).state() == "killed"
    finally:
        if child.poll() is None:
            child.kill()
        w.close()
