"""The contract the twin's hot paths rely on in SimPy's internals (twin/engine.py): a bare entry pushed with
`TwinEnvironment.push` runs at its time, in the order a Timeout created at the same moment would, its
callbacks are cleared by the step (so it can be re-armed and pushed again), and the event count covers it.
SimPy is pinned in pyproject.toml to the versions this passes on."""

from __future__ import annotations

import simpy
from mixfleet.twin.engine import Entry, TwinEnvironment


def test_bare_entries_run_at_their_time_in_timeout_order() -> None:
    env = TwinEnvironment()
    seen: list[tuple[str, float]] = []
    log = lambda tag: (lambda e: seen.append((tag, env.now)))  # noqa: E731
    env.timeout(1.0).callbacks.append(log("timeout-a"))        # created first: runs before the entry at t=1
    env.push(1.0, Entry([log("entry-b")], None))
    env.timeout(1.0).callbacks.append(log("timeout-c"))        # created after the entry: runs after it
    env.push(0.5, Entry([log("entry-early")], None))
    env.push(0.0, Entry([log("entry-now")], None))
    env.run()
    assert seen == [("entry-now", 0.0), ("entry-early", 0.5), ("timeout-a", 1.0), ("entry-b", 1.0),
                    ("timeout-c", 1.0)]


def test_an_entry_is_cleared_by_the_step_and_can_be_rearmed() -> None:
    env = TwinEnvironment()
    calls = []

    class Session:  # the world's sessions are their own entries: callbacks and _ok only
        _ok = True
        callbacks: list | None = None

    s = Session()
    cbs = [lambda e: calls.append((e, env.now))]
    s.callbacks = cbs
    env.push(2.0, s)
    env.run()
    assert calls == [(s, 2.0)] and s.callbacks is None and cbs  # the shared list itself is untouched
    s.callbacks = cbs
    env.push(1.5, s)
    env.run()
    assert calls[-1] == (s, 3.5)


def test_entries_mix_with_processes_and_are_counted() -> None:
    env = TwinEnvironment()
    before = env.scheduled
    ticks = []

    def proc():
        for _ in range(3):
            yield env.timeout(1.0)
            ticks.append(env.now)
            env.push(0.25, Entry([lambda e: ticks.append(e.value)], f"after {env.now}", gen=7))

    done = env.process(proc())
    env.run(until=done)
    assert ticks == [1.0, "after 1.0", 2.0, "after 2.0", 3.0]
    assert env.scheduled - before >= 3 + 3 and isinstance(env, simpy.Environment)
