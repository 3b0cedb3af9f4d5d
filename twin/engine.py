"""The one place the twin reaches into SimPy's internals (SimPy pinned in pyproject.toml to the versions
tests/test_twin_engine.py passes on).

The twin's hot paths (a tool call ends, a replica wakes up) are about two events per turn over millions of
turns, so they skip SimPy's Event/Timeout objects and push *bare entries* onto SimPy's event queue: any
object with a `callbacks` list (callables taking the entry) and `_ok = True`. The contract this relies on
(SimPy 4.1's `Environment.step`): the queue is a heap of (time, priority, id, event); `step` pops the
smallest, sets `env.now` to its time, replaces the entry's `callbacks` with None (an entry is re-armed by
setting them again before the next push) and calls each callback with the entry. An entry pushed with
`push` sorts with SimPy's own events exactly as a `Timeout` of the same delay created at that moment
(NORMAL priority, the next insertion id), so a run's event order and results are those of Timeouts.
"""

from __future__ import annotations

from heapq import heappush
from typing import Any

import simpy
from simpy.events import NORMAL


class TwinEnvironment(simpy.Environment):
    """A SimPy environment with a fast path for bare entries (see the module docstring) and an event count."""

    @property
    def scheduled(self) -> int:
        """Events scheduled so far (SimPy numbers every scheduled event; peeking costs one number)."""
        return next(self._eid)

    def push(self, delay_s: float, entry: Any) -> None:
        """Schedule `entry` `delay_s` (>= 0) seconds from now, ordered as a Timeout created now would be."""
        heappush(self._queue, (self._now + delay_s, NORMAL, next(self._eid), entry))


class Entry:
    """A bare queue entry for `TwinEnvironment.push`: shared callbacks (one list per kind of entry), a value
    and a generation (the world ignores an entry whose generation is stale)."""
    __slots__ = ("callbacks", "value", "gen")
    _ok = True

    def __init__(self, callbacks: list, value: Any, gen: int = 0) -> None:
        self.callbacks, self.value, self.gen = callbacks, value, gen
