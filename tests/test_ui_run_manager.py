"""The app's managed runs (ui/run_manager.py) and their Runs-page controls, for real: `mixfleet run` started
as a background process of its own, found again from its folder after the app's state is gone, refused where
it would start twice or overwrite something, killed (SIGKILL to its process group) with the run log left
readable. The full loop (start -> stop -> resume -> calibrate -> re-plan) is the browser test's
(tests/test_ui_browser.py); a stop and resume with each update exactly once is checked there with pandas.
"""

from __future__ import annotations

import json
import os
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
    """A record whose pid now belongs to another process (other start time, or a process that is not this folder's
    `mixfleet run`) reads as not alive (issue 24; a real run of ours reads alive: tests/test_probe2_procs.py)."""
    me = rm.ManagedRun(folder=str(tmp_path), pid=os.getpid(), pid_start=rm._pid_start(os.getpid()) or "",
                       command=[], started_utc="", updates=1)
    assert not me.alive()                 # the right start time, but pytest is not this folder's `mixfleet run`
    other = rm.ManagedRun(folder=str(tmp_path), pid=os.getpid(), pid_start="1", command=[], started_utc="",
                          updates=1)
    assert not other.alive()
    with pytest.raises(rm.RunManagerError, match="not running"):
        rm.kill(other)                    # never signals a process that is not the run's


@pytest.mark.slow
def test_start_find_refuse_twice_kill(tmp_path: Path) -> None:
    """A real `mixfleet run` in the background: found from its folder alone, a second start there refused,
    killed with its process group, the state read back from disk as 'killed' and resumable."""
    from mixfleet.costmodel.specs.model import load_model_spec
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
    """A run log the app did not start has no Stop/Kill/Resume; a run it started does (a real `mixfleet run`
    with the app's signed managed.json; a hand-written one gets none: tests/test_probe2_procs.py), and Kill
    ends it while it is still starting."""
    pytest.importorskip("streamlit.testing.v1")
    from mixfleet.costmodel.records.runlog import RunLogWriter
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model
    from streamlit.testing.v1 import AppTest

    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))
    plan = load_plan("tiny-cpu")
    with RunLogWriter(runs / "foreign", {"source": "runner", "plan": plan.to_dict(), "seed": 0}) as w:
        w.flush()
    app = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")
    at = AppTest.from_file(app, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not [b for b in at.button if b.label.startswith(("Stop", "Kill", "Resume"))]
    init = init_model(load_model_spec("tiny"), tmp_path / "init", seed=0)
    m = rm.start(runs, "mine", _plan_text(), 3, init=str(init))
    try:
        at.run()                              # the run is starting: its panel, with its controls
        assert not at.exception, [e.value for e in at.exception]
        labels = [b.label for b in at.button]
        assert "Stop (after this update)" in labels and "Kill now" in labels
        kill = next(b for b in at.button if b.label == "Kill now")
        kill.click().run()
        deadline = time.monotonic() + 30
        while Path(f"/proc/{m.pid}").exists() and time.monotonic() < deadline:   # killed, then reaped
            time.sleep(0.2)
        assert not Path(f"/proc/{m.pid}").exists()
        assert rm.load(runs / "mine").state() == "killed"
    finally:
        if m.alive():
            os.killpg(m.pid, 9)


def test_eta_after_a_resume_counts_what_is_left_of_the_start_up(tmp_path: Path) -> None:
    """Issue 44: after Continue the ETA left out the restart (17.9 s shown, 115 s taken). Until the resumed
    process logs its first update, the ETA adds what is left of the run's measured start-up (its first update's
    start on the run clock); the pace is the median gap between updates (a restart's gap does not inflate it)."""
    import calendar

    import pandas as pd

    u = pd.DataFrame({"version": [1, 2, 3, 4], "start_s": [31.0, 46.0, 60.0, 92.0],
                      "end_s": [46.0, 60.0, 74.0, 108.0]})     # a stop after 3, a resume whose restart took 18 s
    started = "2026-12-06T03:39:52Z"
    t0 = calendar.timegm(time.strptime(started, "%Y-%m-%dT%H:%M:%SZ"))
    first = rm.ManagedRun(folder=str(tmp_path), pid=0, pid_start="", command=[], started_utc=started, updates=8)
    p = rm.progress(first, updates=u, now_utc=t0 + 5)
    assert (p["done"], p["target"], p["elapsed_s"]) == (4, 8, 108.0)
    assert p["eta_s"] == pytest.approx(4 * 14.0) and p["eta_basis"] == "measured pace"   # gaps 14, 14, 34
    # continued from 4 to 8: no update of the new process yet -> 4 x 14 s + (31 s start-up - 5 s since start)
    cont = rm.ManagedRun(folder=str(tmp_path), pid=0, pid_start="", command=[], started_utc=started, updates=8,
                         resumes=1, done_at_launch=4)
    p = rm.progress(cont, updates=u, now_utc=t0 + 5)
    assert p["eta_s"] == pytest.approx(4 * 14.0 + 26.0) and p["eta_basis"] == "measured pace + start-up"
    assert rm.progress(cont, updates=u, now_utc=t0 + 60)["eta_s"] == pytest.approx(4 * 14.0)   # start-up over
    p = rm.progress(cont, 10.0, updates=u, now_utc=t0 + 5)                  # the twin's pace, the same start-up
    assert p["eta_s"] == pytest.approx(4 * 10.0 + 26.0) and p["eta_basis"] == "twin + start-up"
    # once the resumed process has logged an update, its start-up is behind it
    more = pd.concat([u, pd.DataFrame({"version": [5], "start_s": [108.0], "end_s": [122.0]})])
    assert rm.progress(cont, updates=more, now_utc=t0 + 5)["eta_s"] == pytest.approx(3 * 14.0)


def test_the_starting_banner_shows_the_pretraining_progress_a_run_prints() -> None:
    """Issue 44: the first run pretrains the base for minutes and the "starting" banner showed no progress.
    `mixfleet run` prints plain pretraining lines (one per tenth of each phase) into the driver log; the banner
    shows the last one, and nothing once the last step is done."""
    from mixfleet.ui.app_launch import pretrain_step
    from mixfleet.ui.commands.run_live import pretrain_lines

    out: list[str] = []
    demos, steps = pretrain_lines(out.append)
    for d in range(1, 2001):
        demos(d, 2000)
    assert len(out) == 11 and out[0] == "pretraining the base policy: demonstrations 1/2000"   # 0/10 .. 10/10
    log = "rehearsal of 'tiny-cpu' as written\nbase policy: the cached ...\n" + "\n".join(out[:5]) + "\n"
    assert pretrain_step(log) == "pretraining the base policy: demonstrations 800/2000"
    for s in range(1, 151):
        steps(s, 150, {"loss": 2.0 / s})
    assert pretrain_step("\n".join(out[:14])) == "pretraining the base policy: steps 30/150, loss 0.067"
    assert pretrain_step("\n".join(out)) is None                  # the last step: the run is past pretraining
    assert pretrain_step("rehearsal of 'tiny-cpu' as written\n[ 13.7s] ready cpu-bf16#0") is None
