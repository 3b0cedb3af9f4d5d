"""Fidelity of a stopped-and-resumed run (issue 26 item 1).

A resumed run's clock continues from its checkpoint, so each segment pays its own start-up on the run clock,
and the runner's header `loop_s` covers only the segment it closed. Before the fix, `run_metrics` measured every
interval from the last segment's loop start: the resumed run of the issue read 4.93 s per update where its own
summary said 25.31 s, a trainer idle share of -1.777, and every goal "met". The log here is written record by
record the way the runner writes it (stop after update 4, a "resume" event, updates 5-6, header loop_s of the
second segment).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import (
    EventRecord,
    GroupRecord,
    RunLog,
    RunLogWriter,
    TrajectoryRecord,
    UpdateRecord,
)
from mixfleet.costmodel.records.runsummary import loop_clock, summarize
from mixfleet.policies.plan import load_plan
from mixfleet.twin.calibrated import fidelity, run_metrics

PLAN = "tiny-cpu"     # the shipped plan
STARTUP_S = 2.0        # each segment's start-up (Ray, samplers) on the run clock
STEP_S = 20.0          # seconds between update ends inside the loop
TRAIN_S, SYNC_S = 12.0, 1.0


def _resumed_log(folder: Path, *, startup_s: float = STARTUP_S) -> None:
    plan = load_plan(PLAN).to_dict()
    groups = [g["name"] for g in plan["groups"]]
    w = RunLogWriter(folder, {"source": "runner", "plan": plan, "seed": 0}, flush_every_s=None)
    pid = 0

    def segment(t_start: float, versions: range) -> float:
        nonlocal pid
        loop0 = t_start + startup_s
        end = loop0
        for v in versions:
            for i, g in enumerate(groups):
                for s in range(2):
                    w.append(TrajectoryRecord(
                        run_id=w.run_id, prompt_id=pid, sample_index=s, group=g, replica=0, version_start=v - 1,
                        version_end=v - 1, turns=2, prompt_tokens=40, generated_tokens=30 + i, start_s=end,
                        end_s=end + STEP_S - 1, reward=0.5, finish_reason="done", trained_version=v))
                pid += 1
            end += STEP_S
            w.append(UpdateRecord(
                version=v, start_s=end - TRAIN_S - SYNC_S, end_s=end, train_step_s=TRAIN_S, weight_sync_s=SYNC_S,
                tokens=500, trajectories=2 * len(groups), staleness_mean=0.5, staleness_p50=0.0, staleness_p95=1.0,
                staleness_max=1, cost_sampler_usd=0.01 * v, cost_trainer_usd=0.002 * v, kl_k3=0.001,
                extreme_low_share=0.001, extreme_high_share=0.002, reward_mean=0.5))
            for g in groups:
                w.append(GroupRecord(version=v, group=g, replicas_up=1.0, utilization=0.9, tokens_generated=60,
                                     samples=2, share_of_samples=1 / len(groups), kl_k3=0.001, extreme_share=0.003,
                                     cost_usd=0.003, tokens_trained=150))
        return end

    end1 = segment(0.0, range(1, 5))                      # Stop after update 4
    w.append(EventRecord(time_s=end1 + 0.5, kind="resume", version=4, detail=json.dumps({"first_prompt_id": pid})))
    resume_at = end1 + 0.5
    end2 = segment(resume_at, range(5, 7))                # Resume, finish at 6
    w.update_header(loop_s=end2 - (resume_at + startup_s))   # the runner's header: the last segment's loop
    w.close("finished")


def test_loop_clock_leaves_each_segments_start_up_out(tmp_path: Path) -> None:
    _resumed_log(tmp_path / "run")
    c = loop_clock(tmp_path / "run")
    assert c.segments == 2
    assert c.intervals.tolist() == pytest.approx([STEP_S] * 6)
    assert c.span_s == pytest.approx(6 * STEP_S)
    s = summarize(tmp_path / "run")                         # the run's own card: start-ups and the stop gap in
    assert s.elapsed_s == pytest.approx(6 * STEP_S + 2 * STARTUP_S + 0.5)
    # the card's time per update is the loop's, as fidelity measures it: the start-ups and the stop are outside it
    # (before: 8 updates stopped and resumed in the app read 106.6 s per update on the card, 76.0 s in fidelity)
    assert s.time_per_update_mean_s == pytest.approx(STEP_S) and s.segments == 2
    assert s.outside_loop_s == pytest.approx(2 * STARTUP_S + 0.5)
    assert s.trainer_idle_share == pytest.approx(1 - (TRAIN_S + SYNC_S) / STEP_S)


def test_fidelity_of_a_resumed_run_measures_what_its_summary_says(tmp_path: Path) -> None:
    _resumed_log(tmp_path / "run")
    m = run_metrics(tmp_path / "run")
    s = summarize(tmp_path / "run")
    # within 10 % of the run's own summary (the difference is the two start-ups and the stop, 4.5 s of 124.5)
    assert m["time_per_update_mean_s"] == pytest.approx(s.time_per_update_mean_s, rel=0.10)
    assert m["time_per_update_mean_s"] == pytest.approx(STEP_S)      # old code: 4.93-like (here -1.3 s)
    assert m["time_per_update_p95_s"] == pytest.approx(STEP_S)
    assert 0.0 <= m["trainer_idle_share"] <= 1.0                      # old code: -1.6
    assert m["trainer_idle_share"] == pytest.approx(1 - (TRAIN_S + SYNC_S) / STEP_S)
    rep = fidelity(None, tmp_path / "run", None)
    shares = [r for r in rep.rows if r.unit == "share"]
    assert shares and all(0.0 <= x <= 1.0 for r in shares for x in (r.measured, r.predicted)), shares
    assert rep.row("time_per_update_mean_s").measured == pytest.approx(STEP_S)


def test_long_start_ups_stay_out_of_the_loop(tmp_path: Path) -> None:
    """A 30 s start-up per segment (the issue's run): the loop's pace is still measured, never a negative interval."""
    _resumed_log(tmp_path / "run", startup_s=30.0)
    m = run_metrics(tmp_path / "run")
    assert m["time_per_update_mean_s"] == pytest.approx(STEP_S)
    assert 0.0 <= m["trainer_idle_share"] <= 1.0


def test_the_fidelity_note_says_what_the_resumed_runs_summary_counts(tmp_path: Path) -> None:
    _resumed_log(tmp_path / "run", startup_s=30.0)
    rep = fidelity(None, tmp_path / "run", None)
    note = next(n for n in rep.notes if "segments" in n)
    assert "2 segments" in note and "60.5 s of start-ups and stops left out" in note, note
    # the card leaves the same start-ups out (runsummary: time per update on the loop), so the note must not say the
    # summary counts them (the probe: "the fidelity note and the run card contradict each other"), and the figure
    # it quotes for the card is the one fidelity measures
    s = summarize(tmp_path / "run")
    assert "counts" not in note and "as on the run's card" in note, note
    assert f"{s.time_per_update_mean_s:.2f} s" in note
    assert s.time_per_update_mean_s == pytest.approx(rep.row("time_per_update_mean_s").measured)


@pytest.mark.slow
def test_a_real_run_killed_and_resumed(killed_resumed_run: dict) -> None:
    """The honest reproduction: a real run (tests/test_run_resume.py's plan and child, conftest.py's
    `killed_resumed_run`, which tests/test_run_resume.py reads too) killed after update 2 of 4 and resumed to 4,
    read as it was then (before that test's continuation). On the old code its trainer idle share read negative
    (-0.34 here, 2026-12-01)."""
    code, lines, err = killed_resumed_run["killed"]
    assert code is None and lines[-1].startswith("UPDATE 2"), lines
    code, lines, err = killed_resumed_run["resumed"]
    assert code == 0 and lines[-1].startswith("UPDATE 4"), (lines, err)
    out = killed_resumed_run["resumed_copy"]
    m, s, c = run_metrics(out), summarize(out), loop_clock(out)
    assert c.segments == 2 and (c.intervals > 0).all(), c
    assert 0.0 <= m["trainer_idle_share"] <= 1.0, m
    # the run's own summary less what the loop leaves out (each segment's start-up, the killed segment's tail)
    log_ev = RunLog.open(out)
    tr, ev = log_ev.trajectories, log_ev.events
    resume_at = float(ev.loc[ev["kind"] == "resume", "time_s"].iloc[0])
    seg2_loop = float(tr.loc[tr["start_s"] >= resume_at, "start_s"].min())
    seg1_loop, seg1_end = float(tr["start_s"].min()), float(log_ev.updates["end_s"].iloc[1])
    loop = (seg1_end - seg1_loop) + (s.elapsed_s - seg2_loop)
    assert m["time_per_update_mean_s"] == pytest.approx(loop / 4, rel=0.10)
