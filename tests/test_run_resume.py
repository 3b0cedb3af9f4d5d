"""`--resume` of a real run (tiny model, one sampler group, Ray actors, Megatron-core trainer) killed with
SIGKILL at the staleness bound, and of a finished run continued to more updates (issue 13.1).

With `max_staleness = 0, stale = "wait"` the batcher admits prompt n only while n < (v + 1) x ppu, and the
run sits at that bound whenever the trainer is the bottleneck (its normal steady state): at the checkpoint
of update v, (v + 1) x ppu prompts have started. Before the fix, a resume restored that count although those
prompts died with the killed run, so nothing was ever admitted and the run idled after "ready"; the same
held for a finished run continued to more updates. Each run is a child process (tests/run_child.py) so that
a hang is a failed test, not a hung suite; the run is conftest.py's `killed_resumed_run`, which
tests/test_fidelity_resume.py reads too.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mixfleet.costmodel.records.runlog import RunLog
from runplans import CPU_BF16, run_plan_toml

pytestmark = pytest.mark.slow

PPU = 2
PLAN = run_plan_toml(
    "test-resume", [CPU_BF16], embedded={"max_turns": 2, "max_new_tokens": 8},
    batcher={"prompts_per_update": PPU, "samples_per_prompt": 2, "inflight_prompts": 8, "max_staleness": 0,
             "stale": "wait"})
RUN_TIMEOUT_S = 300                    # a run of 1-2 updates takes well under a minute of CPU; a hang never ends
CHILD = str(Path(__file__).with_name("run_child.py"))


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.strip())
    lines.put(None)


def _run(argv: list[str], root: Path, name: str, *, kill_after: int | None = None) -> tuple[int | None, list[str]]:
    """Run a child to its end, or SIGKILL its process group after its line UPDATE `kill_after` or after
    RUN_TIMEOUT_S; returns (its exit code, None when killed; its stdout lines)."""
    err = open(root / f"{name}.err", "w")  # noqa: SIM115 - closed below
    child = subprocess.Popen([sys.executable, CHILD, *argv, "--plain"], stdout=subprocess.PIPE, stderr=err, text=True,
                             start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                break                                     # still running at the deadline: a hang
            if line is None:                              # its output closed: it exited
                child.wait(30)
                break
            seen.append(line)
            if kill_after is not None and line.startswith(f"UPDATE {kill_after} "):
                break
    finally:
        code = child.poll()
        if code is None:
            os.killpg(child.pid, signal.SIGKILL)          # the whole run: driver, Ray, actors
            child.wait(30)
        err.close()
    return code, seen


def _state(out: Path) -> dict:
    return json.loads((out / "trainer_state" / "orchestrator.json").read_text())


def _check_log(out: Path, n: int, resumes: int) -> None:
    log = RunLog.open(out)
    assert log.header["status"] == "finished" and log.header["resumes"] == resumes
    assert sorted(log.updates["version"].tolist()) == list(range(1, n + 1))      # each update once
    tr = log.trajectories
    counts = tr[tr["trained_version"] > 0].groupby("trained_version").size().to_dict()
    assert counts == dict(zip(log.updates["version"], log.updates["trajectories"], strict=True))


def test_resume_after_kill_at_the_staleness_bound_and_continue_a_finished_run(killed_resumed_run: dict) -> None:
    """conftest.py's `killed_resumed_run`: killed after update 2 of 4, resumed to 4, continued to 5."""
    runs = killed_resumed_run
    code, lines, err = runs["killed"]
    assert code is None and lines[-1].startswith("UPDATE 2"), (lines, err)
    st = runs["killed_state"]
    assert st["version"] == 2 and st["started_prompts"] == (2 + 0 + 1) * PPU     # killed at the bound

    code, lines, err = runs["resumed"]
    assert code == 0, f"the resumed run did not finish in {RUN_TIMEOUT_S} s: {lines[-3:]}; stderr ends:\n{err}"
    assert lines[-1].startswith("UPDATE 4")
    _check_log(runs["resumed_copy"], 4, resumes=1)
    assert runs["resumed_state"]["started_prompts"] >= 5 * PPU                    # a finished run at its bound

    code, lines, err = runs["continued"]
    assert code == 0, f"the continued run did not finish in {RUN_TIMEOUT_S} s: {lines[-3:]}; stderr ends:\n{err}"
    _check_log(runs["out"], 5, resumes=2)
