"""Issue 44 (third probe): the run log and the trainer state stay consistent at every crash point of an update,
the first update's included. A real tiny run (Ray, the trainer, one embedded CPU sampler group) through
`mixfleet run`, killed (SIGKILL of the driver, as `kill -9` or a power cut) right after each named write of an
update (`MIXFLEET_DIE_AT=POINT@VERSION`, costmodel/records/writepoints.py), each time resumed with `--resume`,
which rolls the log back to the last completed checkpoint (or to the base policy). At the end: updates 1..3 once
each, every update's trained trajectories once, no (prompt, sample) twice.

Before: a kill after update 1's `updates` part (its checkpoint not yet complete) left a run `--resume` refused for
ever ("Put the trainer_state folder back", a folder that never existed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.costmodel.records.writepoints import ENV, POINTS
from test_run_resume import PLAN, RUN_TIMEOUT_S, _check_log

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# the chain of deaths: each write of update 1 until its state exists (the resume goes back to the base policy),
# then the two writes of update 2 that follow its state, once a checkpoint of update 1 is there: orchestrator@2
# (every part of update 2 is in the log: the resume cuts them all back to the checkpoint) and checkpoint@2 (the
# checkpoint of update 2 is complete: nothing to cut). Every write point is hit; published@2 and part:updates@2
# (in the chain until issue 43) are left out: each is published@1 / part:updates@1 again, with the cut back to a
# checkpoint that orchestrator@2 makes of all four tables (2 runs of ~17 s less). part:events is not written at
# every update, so it is left out.
# The first death is the trainer's (its Ray actor SIGKILLed the instant update 1's part is written; the driver goes
# on and fails at the checkpoint), every other the driver's.
CHAIN = ["trainer/part:updates@1", "published@1", "part:trajectories@1", "part:updates@1", "part:groups@1", "state@1",
         "orchestrator@2", "checkpoint@2"]


def _cli(argv: list[str], die_at: str | None) -> tuple[int | None, str, str]:
    env = {**os.environ, "RAY_memory_monitor_refresh_ms": "0"}
    env.pop(ENV, None)
    if die_at:
        env[ENV] = die_at
    cmd = [sys.executable, "-m", "mixfleet.ui.cli", "run", *argv, "--quiet", "--eval-every", "0",
           "--trainer-threads", "1"]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                             start_new_session=True)
    try:
        out, err = child.communicate(timeout=RUN_TIMEOUT_S)
        code: int | None = child.returncode
    except subprocess.TimeoutExpired:
        code = None
        out, err = "", "timed out"
    finally:
        if child.poll() is None or code == -signal.SIGKILL:
            with_group_killed(child.pid)                  # the dead driver's Ray, and a hang
    return code, out, err


def with_group_killed(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _checkpoint_version(out: Path) -> int:
    return int(json.loads((out / "trainer_state" / "trainer_meta.json").read_text())["version"])


def _consistent(out: Path) -> dict[str, Any]:
    """What a resume may rely on, after any death: the log reads; no update twice; no (prompt, sample) twice."""
    log = RunLog.open(out)
    v = log.updates["version"].tolist()
    tr = log.trajectories
    assert len(v) == len(set(v)), v
    assert not tr.duplicated(["prompt_id", "sample_index"]).any()
    return {"versions": sorted(v), "resumes": log.header.get("resumes", 0)}


def test_a_death_at_each_write_of_an_update_leaves_a_run_that_resumes(tmp_path: Path) -> None:
    from runplans import run_files

    driver = [p for p in CHAIN if "/" not in p]
    assert {p.split("@")[0] for p in driver} == set(POINTS) - {"part:events"}     # every write but events'
    init, plan = run_files(tmp_path, PLAN)
    out = tmp_path / "run"
    base = [str(plan), "--out", str(out), "--init", str(init), "--updates", "3"]
    for i, point in enumerate(CHAIN):
        code, so, se = _cli(base + (["--resume"] if i else []), point)
        if point.startswith("trainer/"):      # one line naming what died and how to go on, not Ray's 150
            said = [ln for ln in se.splitlines() if ln.strip()]
            assert code == 1 and "Traceback" not in se, f"{point}: exit {code}\n{se[-3000:]}"
            assert "the trainer (TrainerWorker) died" in said[-1] and "--resume" in said[-1], se[-3000:]
            assert not (out / "trainer_state").exists()          # update 1's checkpoint never completed
        else:
            assert code == -signal.SIGKILL, f"{point}: exit {code}, not killed there\n{se[-3000:]}"
        seen = _consistent(out)
        if point == "part:updates@1":
            assert seen["versions"] == [1] and not (out / "trainer_state").exists()   # the case resume refused
        if point == "orchestrator@2":    # update 2 logged, its checkpoint not complete: the resume cuts it back to 1
            assert seen["versions"] == [1, 2] and _checkpoint_version(out) == 1
        if point == "checkpoint@2":
            assert seen["versions"] == [1, 2] and _checkpoint_version(out) == 2
    code, so, se = _cli(base + ["--resume"], None)
    assert code == 0, se[-3000:]
    _check_log(out, 3, resumes=len(CHAIN))
    _consistent(out)
    events = RunLog.open(out).events
    notes = " ".join(events[events["kind"] == "resume"]["detail"].tolist())
    assert "update 1's checkpoint was never completed: its rows are rolled back" in notes
