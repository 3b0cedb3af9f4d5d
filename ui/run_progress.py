"""How far a managed run is (`progress`): updates done of its target, elapsed run seconds and an ETA, at the
twin's time per update or the run's own pace, plus what is left of a resumed process's start-up. Read from the
run log; the managed run itself (its record, its process) is ui/run_manager.py's `ManagedRun`.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixfleet.ui.run_manager import ManagedRun


def progress(m: ManagedRun, predicted_s_per_update: float | None = None, updates: Any = None,
             now_utc: float | None = None) -> dict[str, Any]:
    """Updates done / target, elapsed run seconds, and an ETA: the remaining updates at the twin's time per update
    if given, else at the run's own pace (the median gap between consecutive updates), plus, while a resumed
    process has not logged its first update yet, what is left of its start-up (Ray, samplers, the checkpoint),
    measured as the run's first start-up: its first update's start on the run clock. `updates`: the run log's
    updates frame if the caller has read it already (the Runs page has, cached); else it is read here."""
    import numpy as np
    import pandas as pd

    done, elapsed, pace, startup = 0, None, None, None
    if updates is None:
        from mixfleet.costmodel.records.runlog import RunLog

        with contextlib.suppress(Exception):
            updates = RunLog.open(m.run_dir).updates
    if updates is not None and len(updates):
        u = pd.DataFrame({"version": pd.to_numeric(updates["version"], errors="coerce"),
                          "start_s": pd.to_numeric(updates["start_s"], errors="coerce"),
                          "end_s": pd.to_numeric(updates["end_s"], errors="coerce")}).dropna().sort_values("version")
        if len(u):
            done, elapsed = int(u["version"].max()), float(u["end_s"].max())
            gaps = np.diff(u["end_s"].to_numpy())
            gaps = gaps[gaps > 0]
            pace = float(np.median(gaps)) if len(gaps) else (elapsed / done if done else None)
            startup = float(u["start_s"].iloc[0])
    remaining = max(0, m.updates - done)
    eta, basis = None, None
    if remaining and predicted_s_per_update and predicted_s_per_update > 0:
        eta, basis = remaining * predicted_s_per_update, "twin"
    elif remaining and pace:
        eta, basis = remaining * pace, "measured pace"
    if eta is not None and m.resumes and done <= m.done_at_launch and startup:
        since = _since_utc(m.started_utc, now_utc)
        eta += max(0.0, startup - since)
        basis = f"{basis} + start-up"
    return {"done": done, "target": m.updates, "elapsed_s": elapsed, "eta_s": eta, "eta_basis": basis}


def _since_utc(stamp: str, now: float | None = None) -> float:
    """Seconds from a `_utc()` stamp to `now` (epoch seconds; default: now); 0 for an unreadable stamp."""
    import calendar

    try:
        then = calendar.timegm(time.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ"))
    except (TypeError, ValueError):
        return 0.0
    return max(0.0, (time.time() if now is None else now) - then)
