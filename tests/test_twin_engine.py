"""The contract the twin's hot paths rely on in SimPy's internals (twin/engine.py): a bare entry pushed with
`TwinEnvironment.push` runs at its time, in the order a Timeout created at the same moment would, its
callbacks are cleared by the step (so it can be re-armed and pushed again), and the event count covers it.
SimPy is pinned in pyproject.toml to the versions this passes on."""

from __future__ import annotations

import random

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


def test_a_random_mix_of_entries_and_simpy_events_runs_as_timeouts_would() -> None:
    # Each callback schedules more work with seeded random delays (ties at equal times included) and sometimes
    # succeeds a plain Event (URGENT priority); a process ticks alongside. Run once with bare entries on the
    # calendar and once with every entry replaced by a Timeout: the same order, times and event count.
    def scenario(entries: bool) -> tuple[list, int]:
        env, rng, seen = TwinEnvironment(), random.Random(7), []

        def schedule(tag: int, delay: float) -> None:
            if entries:
                env.push(delay, Entry([fire], tag))
            else:
                env.timeout(delay, value=tag).callbacks.append(fire)

        def fire(e) -> None:
            tag = e.value
            seen.append((tag, env.now))
            if len(seen) < 3000:
                for k in range(rng.choice([1, 1, 2, 0, 2])):
                    schedule(tag * 3 + k, rng.choice([0.0, 0.5, 1.0, rng.random()]))
                if rng.random() < 0.1:
                    ev = env.event()
                    ev.callbacks.append(lambda _e, tag=tag: seen.append(("urgent", tag, env.now)))
                    ev.succeed()

        def ticker():
            while True:
                yield env.timeout(0.5)
                seen.append(("tick", env.now))

        env.process(ticker())
        for i in range(20):
            schedule(i, rng.random())
        env.run(until=40.0)
        return seen, env.scheduled

    a, b = scenario(entries=True), scenario(entries=False)
    assert len(a[0]) > 3000 and a == b and any(x[0] == "urgent" for x in a[0])
