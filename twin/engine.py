"""The one place the twin reaches into SimPy's internals (SimPy pinned in pyproject.toml to the versions
tests/test_twin_engine.py passes on).

The twin's hot paths (a tool call ends, a replica wakes up) are about two events per turn over millions of
turns, so they skip SimPy's Event/Timeout objects and its Python `step`: they are *bare entries* (any object
with a `callbacks` list of callables taking the entry, and `_ok = True`) on `TwinEnvironment.calendar`, a
compiled sub-calendar (twin/core.py's `Calendar`) merged with SimPy's queue. The contract this relies on
(SimPy 4.1): `env._queue` is a heap of (time, priority, id, event) and `env._eid` the counter the ids come
from; `Environment.step` pops the smallest, sets `env._now` to its time, replaces the event's `callbacks`
with None and calls each callback with the event. An entry pushed with `push` draws its id from that counter
at NORMAL priority, so it runs exactly where a `Timeout` of the same delay created at that moment would, among
SimPy's own events; a run's event order, event count and results are those of Timeouts.
"""

from __future__ import annotations

from typing import Any

import simpy
from mixfleet.twin.core import Calendar, Entry
from simpy.events import NORMAL

__all__ = ["Entry", "TwinEnvironment"]  # Entry: a compiled class, with the hot path in twin/core.py
if NORMAL != 1:  # twin/core.py's Calendar orders its entries at SimPy's NORMAL priority, 1
    raise ImportError(f"simpy.events.NORMAL is {NORMAL}; twin/core.py assumes 1 (pin SimPy as pyproject.toml does)")


class TwinEnvironment(simpy.Environment):
    """A SimPy environment with a sub-calendar for bare entries (see the module docstring) and an event count."""

    def __init__(self, initial_time: float = 0) -> None:
        super().__init__(initial_time)
        self.calendar = Calendar(self)

    @property
    def scheduled(self) -> int:
        """Events scheduled so far, bare entries included (SimPy numbers every event; peeking costs one number)."""
        return next(self._eid)

    def push(self, delay_s: float, entry: Any) -> None:
        """Schedule `entry` `delay_s` (>= 0) seconds from now, ordered as a Timeout created now would be."""
        self.calendar.push(delay_s, entry)
