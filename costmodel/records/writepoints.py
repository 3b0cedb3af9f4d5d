"""The named writes of one update of a run, where a test kills the process to check that the run log and the
trainer state stay consistent at every crash point (tests/test_run_crash_points.py).

Set `MIXFLEET_DIE_AT=POINT@VERSION` and the process kills itself (SIGKILL: no handler, no flush, as a power cut
or `kill -9`) right after that write of that update. The points, in order (runner/orchestration/orchestrator.py
`Orchestrator.run`): `published` (the update's weights exported, nothing of it logged), `part:trajectories`,
`part:updates`, `part:groups`, `part:events` (each table's part file of the update, costmodel/records/runlog_writer.py),
`state` (the trainer's state in the staging folder), `orchestrator` (orchestrator.json beside it), `checkpoint`
(the staging folder has replaced trainer_state). Unset (always, outside tests): nothing happens.

`MIXFLEET_DIE_AT=trainer/POINT@VERSION` kills the trainer's process instead (SIGKILL of the Ray actor the
orchestrator registered with `victim("trainer", pid)`), and the driver goes on: what a trainer that dies the
instant an update's part is written leaves behind.
"""

from __future__ import annotations

import os
import signal

ENV = "MIXFLEET_DIE_AT"
POINTS = ("published", "part:trajectories", "part:updates", "part:groups", "part:events", "state", "orchestrator",
          "checkpoint")
_update: list[int | None] = [None]        # the update whose writes are under way (set by the orchestrator)
_victims: dict[str, int] = {}             # another process a test may kill, by name: its pid


def wants(who: str) -> bool:
    """Whether MIXFLEET_DIE_AT names a death of process `who` (e.g. "trainer"): register it with `victim`."""
    return os.environ.get(ENV, "").startswith(f"{who}/")


def victim(who: str, pid: int) -> None:
    """`who`'s process is `pid` (killed when MIXFLEET_DIE_AT=who/POINT@VERSION is reached)."""
    _victims[who] = pid


def begin(version: int | None) -> None:
    """The writes that follow belong to update `version` (None: to no update)."""
    _update[0] = version


def reached(point: str) -> None:
    """`point` of the current update was written: die here if MIXFLEET_DIE_AT names it."""
    want = os.environ.get(ENV)
    if not want or _update[0] is None:
        return
    who, _, at = want.rpartition("/")
    if at != f"{point}@{_update[0]}":
        return
    if not who:
        os.kill(os.getpid(), signal.SIGKILL)
    elif who in _victims:
        os.kill(_victims.pop(who), signal.SIGKILL)
