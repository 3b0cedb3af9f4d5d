"""A killed run reads "killed" and can be calibrated from its completed updates (issue 44, the newcomer's walk).

Kill sends SIGKILL: the run log's header is never closed and keeps "running". Before the fix the Runs page's
run-log line read "status running" and "Calibrate and re-plan" said "Available once the run has finished or
stopped" until the run was resumed. The managed record here is the one `run_manager.kill` leaves (killed_utc set,
its process gone); the run log is written record by record as the runner writes it, never closed."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import GroupRecord, RunLogWriter, TrajectoryRecord, UpdateRecord
from mixfleet.policies.plan import load_plan
from mixfleet.ui import run_manager as rm

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")


def _killed_run(runs: Path, name: str = "killed-one", updates: int = 3) -> Path:
    folder = runs / name
    plan = load_plan("tiny-cpu").to_dict()
    groups = [g["name"] for g in plan["groups"]]
    header = {"source": "runner", "plan": plan, "seed": 0,
              "runner": {"mode": "async", "fleet_mode": "embedded", "task": "guess", "updates": 5,
                         "groups": {g: {"replicas": 1, "planned_replicas": 1} for g in groups}}}
    w = RunLogWriter(folder / rm.RUN_SUBDIR, header, flush_every_s=None)
    pid, end = 0, 3.0
    for v in range(1, updates + 1):
        for i, g in enumerate(groups):
            for s in range(6):
                w.append(TrajectoryRecord(run_id=w.run_id, prompt_id=pid, sample_index=s, group=g, replica=0,
                                          version_start=v - 1, version_end=v - 1, turns=2, prompt_tokens=40,
                                          generated_tokens=30 + 5 * i + 7 * s, start_s=end + s,
                                          end_s=end + 4 + i + 1.1 * s,
                                          reward=0.5, finish_reason="done", trained_version=v))
            pid += 1
        end += 12.0 + v
        w.append(UpdateRecord(version=v, start_s=end - 3, end_s=end, train_step_s=2.0 + 0.1 * v, weight_sync_s=1.0,
                              tokens=300, trajectories=6 * len(groups), staleness_mean=0.5, staleness_p50=0.0,
                              staleness_p95=1.0, staleness_max=1, cost_sampler_usd=0.01 * v,
                              cost_trainer_usd=0.002 * v, kl_k3=0.001, reward_mean=0.5))
        for g in groups:
            w.append(GroupRecord(version=v, group=g, replicas_up=1.0, utilization=0.9, tokens_generated=60,
                                 samples=6, share_of_samples=1 / len(groups)))
    w.flush()                 # never closed: SIGKILL leaves the header "running"
    gone = subprocess.Popen(["true"])
    gone.wait()
    rm.save(rm.ManagedRun(folder=str(folder.resolve()), pid=gone.pid, pid_start="1", command=["mixfleet", "run"],
                          started_utc="2026-12-05T10:00:00Z", updates=5, killed_utc="2026-12-05T10:01:00Z"))
    return folder / rm.RUN_SUBDIR


def test_a_killed_run_reads_killed_and_is_calibrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))
    run = _killed_run(runs)
    assert '"status": "running"' in (run / "run.json").read_text().replace('":"', '": "')
    assert rm.load(run.parent).state() == "killed"
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    pick = at.selectbox(key="runs_pick")
    assert pick.format_func(pick.value).endswith(" · killed"), pick.format_func(pick.value)
    line = [c.value for c in at.caption if c.value.startswith("source **runner**")]
    assert line and "status **killed**" in line[0], line
    assert not any("Available once the run has finished or stopped" in c.value for c in at.caption)
    at.button(key="runs_cal_fit").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    assert any(c.value.startswith("written to `") for c in at.caption)
    assert list((runs).rglob("*calibration*.toml"))


def test_fidelity_after_more_updates_says_when_it_was_computed(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 (stale widgets): the fidelity table checked before Continue added updates kept showing as if current;
    now it says "Computed at N updates" and warns once the run has more."""
    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))
    run = _killed_run(runs)
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    at.button(key="runs_fidelity").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(c.value.startswith("Computed at 3 updates") for c in at.caption)
    assert not any("the run now has" in w.value for w in at.warning)
    w = RunLogWriter(run, {}, flush_every_s=None)        # the run continued: one more update
    w.append(UpdateRecord(version=4, start_s=70.0, end_s=75.0, train_step_s=2.0, weight_sync_s=1.0, tokens=300,
                          trajectories=6, staleness_mean=0.5, staleness_p50=0.0, staleness_p95=1.0, staleness_max=1,
                          cost_sampler_usd=0.04, cost_trainer_usd=0.008, kl_k3=0.001, reward_mean=0.5))
    w.flush()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(x.value.startswith("Computed at 3 updates; the run now has 4") for x in at.warning), \
        [x.value for x in at.warning]


def test_in_sample_fidelity_is_labelled_and_goals_read_met_or_missed(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 (the calibration loop): fidelity with a calibration fitted on the same run was shown as if it
    were a prediction, and the page showed no goal pass / fail (the CLI does). Now the calibration choice says
    in-sample / held-out, an in-sample check says so, and each goal card reads met or missed
    (FidelityReport.goals, the CLI's)."""
    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))
    run = _killed_run(runs)
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    at.button(key="runs_cal_fit").click().run()
    assert not at.error, [e.value for e in at.error]
    at.run()
    box = at.selectbox(key="runs_cal")
    (cal,) = [o for o in box.options if "calibration" in o and not o.startswith("(none")]
    assert cal.endswith("(in-sample: fitted on this run)"), box.options
    at.selectbox(key="runs_cal").set_value(cal.rsplit(" (in-sample", 1)[0]).run()
    at.button(key="runs_fidelity").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(i.value.startswith("In-sample: this calibration was fitted on this run") for i in at.info), \
        [i.value for i in at.info]
    from mixfleet.twin.calibrated import fidelity

    goals = fidelity(None, run, next(runs.rglob("*calibration*.toml"))).goals()
    deltas = {m.label: m.proto.delta for m in at.metric if "error" in m.label}
    assert deltas["time/update error"] == ("goal within 10 %: " + ("met" if goals["time_per_update_within_10pct"]
                                                                  else "missed"))
    assert all(d.startswith("goal ") and d.endswith((": met", ": missed")) for d in deltas.values()), deltas
