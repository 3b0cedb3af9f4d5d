"""The Runs page stays on your run (issue 26 item 2), Streamlit AppTest.

A run started from the app has no run log for a while (Ray, samplers): the page used to drop its pick and fall
back to the newest log, a twin dry run, and stay there once the run's log appeared. A fidelity check's twin log
was named after the run folder, `run` for every managed run, so one run's check overwrote another's and became
every run's overlay and ETA source. The managed runs here are the app's own records (`run_manager.save`, signed);
the "continued" one is resumed for real (`mixfleet run --resume`), and killed at the end of the test.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("streamlit.testing.v1")
from mixfleet.costmodel.records.runlog import GroupRecord, RunLogWriter, UpdateRecord  # noqa: E402
from mixfleet.policies.plan import load_plan  # noqa: E402
from mixfleet.ui import run_manager as rm  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")
PLAN = load_plan("tiny-cpu")


@pytest.fixture()
def runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    r = tmp_path / "runs"
    r.mkdir()
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(r))
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))
    return r


def _log(folder: Path, source: str, status: str = "finished", updates: int = 2) -> None:
    w = RunLogWriter(folder, {"source": source, "plan": PLAN.to_dict(), "seed": 0}, flush_every_s=None)
    for v in range(1, updates + 1):
        w.append(UpdateRecord(version=v, start_s=10.0 * v - 2, end_s=10.0 * v, train_step_s=1.5, weight_sync_s=0.5,
                              tokens=100, trajectories=8, staleness_mean=0.5, staleness_p50=0.0, staleness_p95=1.0,
                              staleness_max=1, cost_sampler_usd=0.1 * v, cost_trainer_usd=0.01 * v, kl_k3=0.01,
                              reward_mean=0.3))
        for g in PLAN.groups:
            w.append(GroupRecord(version=v, group=g.name, replicas_up=1.0, utilization=0.9, tokens_generated=50,
                                 samples=4, share_of_samples=1 / len(PLAN.groups), kl_k3=0.001, extreme_share=0.001,
                                 cost_usd=0.01, tokens_trained=40))
    w.flush()
    if status != "running":
        w.close(status)


def _managed(runs: Path, name: str) -> Path:
    """A run folder as `run_manager.start` leaves it (plan, signed managed.json), its process already gone."""
    folder = runs / name
    folder.mkdir()
    (folder / rm.PLAN_FILE).write_text((Path(__file__).resolve().parents[1] / "data/plans/tiny-cpu.toml").read_text())
    rm.save(rm.ManagedRun(folder=str(folder), pid=os.getpid(), pid_start="0", command=["mixfleet", "run"],
                          started_utc="2026-12-01T00:00:00Z", updates=2,
                          extra={"init": None, "address": None, "attach": [], "embedded": True}))
    return folder / rm.RUN_SUBDIR


def _overlay(at: AppTest):  # type: ignore[no-untyped-def]
    return next(s for s in at.selectbox if s.label == "Overlay the twin's prediction")


def _runs_page() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


@pytest.mark.parametrize("key", ["runs_want", "runs_pick"])
def test_the_page_stays_on_a_started_run_until_its_log_appears(runs: Path, key: str) -> None:
    """Start ("Run for real") sets `key` and switches to the Runs page: runs_want is launch.follow's, runs_pick
    what Start set before (a pick whose log is not listed yet)."""
    _log(runs / "twin" / "dry-a", "twin")                # the planner's / Dry-run page's dry runs
    time.sleep(1.1)
    run = _managed(runs, "mine")
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.session_state[key] = str(run)
    at.switch_page("app_runs.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    # the pending panel of `mine`; its process is gone, so it says so rather than "starting" (issue 26)
    assert any("Run `mine` **exited** before its run log appeared" in e.value for e in at.error)
    _log(run, "runner", status="running")                # its run log appears
    at.run()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="runs_pick").value == str(run)     # old code: stayed on dry-a
    assert at.selectbox(key="runs_pick").options[0].startswith("mine · runner")   # real runs first


def test_after_a_fidelity_check_continue_stays_on_the_run_and_its_own_overlay(runs: Path) -> None:
    mine, other = _managed(runs, "mine"), _managed(runs, "other")
    _log(mine, "runner")
    _log(other, "runner")
    at = _runs_page()
    at.selectbox(key="runs_pick").set_value(str(mine)).run()
    at.button(key="runs_fidelity").click().run()         # the twin fidelity check of `mine`
    assert not at.exception, [e.value for e in at.exception]
    twin = sorted(p.name for p in (runs / "twin").iterdir())
    assert twin == ["fidelity-mine-priors"], twin        # old code: fidelity-run-priors, shared by every run
    overlay = _overlay(at)
    assert overlay.value.endswith("fidelity-mine-priors")
    at.selectbox(key="runs_pick").set_value(str(other)).run()
    assert not [s for s in at.selectbox if s.label == "Overlay the twin's prediction"]   # not mine's prediction
    at.selectbox(key="runs_pick").set_value(str(mine)).run()
    cont = next(b for b in at.button if b.label == "Continue")
    try:
        cont.click().run()                               # `mixfleet run --resume` to 3 updates, for real
        assert not at.exception, [e.value for e in at.exception]
        assert at.selectbox(key="runs_pick").value == str(mine)
        assert _overlay(at).value.endswith("fidelity-mine-priors")
    finally:
        m = rm.load(mine.parent)
        if m is not None and m.alive():
            rm.kill(m)
    assert json.loads((mine / "run.json").read_text())["format"] == "mixfleet-runlog"


def test_a_dead_runs_status_and_the_labelled_resume_target(runs: Path) -> None:
    """A managed run whose process is gone while its log still says "running" (killed, or the list not reread)
    is listed with its process's state; the number box beside Resume says what it is."""
    run = _managed(runs, "mine")
    _log(run, "runner", status="running")                # never closed: the header says "running"
    at = _runs_page()
    assert at.selectbox(key="runs_pick").options[0] == "mine · runner · tiny-cpu · exited"   # was "· running"
    box = at.number_input(key="mr_mine_more")
    assert box.label == "Resume to updates (target)"
    assert box.proto.label_visibility.value == box.proto.label_visibility.VISIBLE    # was collapsed, unlabelled
