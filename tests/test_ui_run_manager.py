"""The app's managed runs (ui/run_manager.py) and their Runs-page controls, for real: `mixfleet run` started
as a background process of its own, found again from its folder after the app's state is gone, refused where
it would start twice or overwrite something, killed (SIGKILL to its process group) with the run log left
readable. The full loop (start -> stop -> resume -> calibrate -> re-plan) is the browser test's
(tests/test_ui_browser.py); a stop and resume with each update exactly once is checked there with pandas.

Nothing a file or a page says about a process is trusted (issue 24, the second probe): a managed.json the app did
not write (by hand, or copied from another folder) is no managed run: the Runs page offers no controls for it and
shows no driver log from the folder it names, and Stop / Kill / Resume refuse it; even a record the app wrote is
signalled only while its pid is this run's `mixfleet run`. A managed run that ended is reaped, and a run's folder
holds the specs its plan names.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.policies.plan import load_plan
from mixfleet.ui import run_manager as rm
from mixfleet.ui.run_progress import progress
from trust_helpers import SECRET, end_all, plan_text, running, sleeper

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")


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
    assert rm.parse_plan(plan_text()).name == "tiny-cpu"


def test_refuses_a_folder_that_holds_anything(tmp_path: Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(rm.RunManagerError, match="not empty"):
        rm.start(tmp_path, "mine", plan_text(), 2)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "mine" / rm.MANAGED_FILE).exists()
    with pytest.raises(rm.RunManagerError, match="updates"):
        rm.start(tmp_path, "new", plan_text(), 0)


def test_a_reused_pid_is_not_taken_for_the_run(tmp_path: Path) -> None:
    """A record whose pid now belongs to another process (other start time, or a process that is not this folder's
    `mixfleet run`) reads as not alive (issue 24; a real run of ours reads alive:
    test_our_own_run_is_still_stopped_and_then_reaped below)."""
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
    m = rm.start(root, "r1", plan_text(), 2, init=str(init))
    try:
        assert m.alive() and m.state() == "running"
        again = rm.find(root)                 # what an app restarted later sees
        assert [x.name for x in again] == ["r1"] and again[0].pid == m.pid and again[0].alive()
        with pytest.raises(rm.RunManagerError, match="running"):
            rm.start(root, "r1", plan_text(), 2, init=str(init))
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
    with the app's signed managed.json; a hand-written one gets none:
    test_the_runs_page_never_offers_controls_or_foreign_logs_for_a_crafted_record below), and Kill ends it while it
    is still starting."""
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
    m = rm.start(runs, "mine", plan_text(), 3, init=str(init))
    try:
        at.run()                              # the run is starting: its panel, with its controls
        assert not at.exception, [e.value for e in at.exception]
        labels = [b.label for b in at.button]
        assert "Stop (after this update)" in labels and "Kill now" in labels
        kill = next(b for b in at.button if b.label == "Kill now")
        kill.click().run()
        assert m.alive()                      # Kill now asks first (issue 44): the confirmation kills
        next(b for b in at.button if b.key == "mr_mine_kill_confirm").click().run()
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
    p = progress(first, updates=u, now_utc=t0 + 5)
    assert (p["done"], p["target"], p["elapsed_s"]) == (4, 8, 108.0)
    assert p["eta_s"] == pytest.approx(4 * 14.0) and p["eta_basis"] == "measured pace"   # gaps 14, 14, 34
    # continued from 4 to 8: no update of the new process yet -> 4 x 14 s + (31 s start-up - 5 s since start)
    cont = rm.ManagedRun(folder=str(tmp_path), pid=0, pid_start="", command=[], started_utc=started, updates=8,
                         resumes=1, done_at_launch=4)
    p = progress(cont, updates=u, now_utc=t0 + 5)
    assert p["eta_s"] == pytest.approx(4 * 14.0 + 26.0) and p["eta_basis"] == "measured pace + start-up"
    assert progress(cont, updates=u, now_utc=t0 + 60)["eta_s"] == pytest.approx(4 * 14.0)   # start-up over
    p = progress(cont, 10.0, updates=u, now_utc=t0 + 5)                  # the twin's pace, the same start-up
    assert p["eta_s"] == pytest.approx(4 * 10.0 + 26.0) and p["eta_basis"] == "twin + start-up"
    # once the resumed process has logged an update, its start-up is behind it
    more = pd.concat([u, pd.DataFrame({"version": [5], "start_s": [108.0], "end_s": [122.0]})])
    assert progress(cont, updates=more, now_utc=t0 + 5)["eta_s"] == pytest.approx(3 * 14.0)


def test_the_starting_banner_shows_the_pretraining_progress_a_run_prints() -> None:
    """Issue 44: the first run pretrains the base for minutes and the "starting" banner showed no progress.
    `mixfleet run` prints plain pretraining lines (one per tenth of each phase) into the driver log; the banner
    shows the last one, and nothing once the last step is done."""
    from mixfleet.runner.orchestration.recipe import pretrain_lines
    from mixfleet.ui.app_launch import pretrain_step

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


def _crafted_record(folder: Path, pid: int, names_folder: Path) -> dict:
    """A managed.json written by hand: another process's pid and real start time, a folder outside the runs
    folder, and launch options nobody chose."""
    rec = {"folder": str(names_folder), "pid": pid, "pid_start": rm._pid_start(pid), "command": ["sleep", "60"],
           "started_utc": "2026-12-01T00:00:00Z", "updates": 3, "resumes": 0,
           "extra": {"init": "/etc", "address": "127.0.0.1:1", "attach": ["g=http://127.0.0.1:9"], "embedded": False}}
    (folder / rm.MANAGED_FILE).write_text(json.dumps(rec))
    return rec


# ---- managed.json written by hand or copied (issue 24, the second probe) -----------------------------------
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
    victim = sleeper()
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
        assert running(victim)
        assert not (folder / rm.LOG_FILE).exists()          # nothing was launched
        assert (outside / rm.LOG_FILE).read_text().count("mixfleet ui:") == 0
    finally:
        end_all(victim)


def test_a_record_of_ours_whose_pid_is_another_process_is_not_signalled(tmp_path: Path, state: Path) -> None:
    """The second check: a record this app signed, naming a live process that is not this run's `mixfleet run`
    (pid and start time right, command line not), reads as not running; Stop and Kill refuse it."""
    folder = (tmp_path / "runs" / "stale").resolve()
    (folder / rm.RUN_SUBDIR).mkdir(parents=True)
    victim = sleeper()
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
        assert running(victim)
        # the same process, were it this run's `mixfleet run` (its argv), would be ours: the check is the argv
        assert rm.run_argv(folder)[:4] == [sys.executable, "-m", "mixfleet.ui.cli", "run"]
    finally:
        end_all(victim)


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
    victim = sleeper()
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
        assert running(victim)
    finally:
        end_all(victim)
        w.close()


# ---- managed runs of ours ------------------------------------------------------------------------------
def test_our_own_run_is_still_stopped_and_then_reaped(tmp_path: Path, state: Path) -> None:
    """A real `mixfleet run` the app started: its record is ours, Stop signals it, and once it has exited it is
    reaped (it stayed a `<defunct>` child of the app)."""
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model

    init = init_model(load_model_spec("tiny"), tmp_path / "init", seed=0)
    root = tmp_path / "runs"
    m = rm.start(root, "ours", plan_text(), 2, init=str(init))
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
    text = rm.self_contained_plan(plan_text(workload=str(spec)), root, folder)
    assert (folder / "workload.toml").read_text() == spec.read_text()
    (folder / rm.PLAN_FILE).write_text(text)
    assert load_plan(folder / rm.PLAN_FILE).workload == str(folder / "workload.toml")
    secret = tmp_path / "secret.toml"
    secret.write_text(f'api_key = "{SECRET}"\n')
    with pytest.raises(SpecError) as e:
        rm.start(root, "outside", plan_text(model=str(secret)), 2)
    assert "field 'model'" in str(e.value) and SECRET not in str(e.value)
    assert not (root / "outside").exists()
