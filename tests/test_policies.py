"""Policies: each decision on hand-made snapshots (routers, autoscalers, batcher, weight sync), and the registry."""

from __future__ import annotations

import dataclasses
import math

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.policies import make, names
from mixfleet.policies.batcher import Batcher
from mixfleet.policies.views import BufferView, FleetView, GroupView, PromptGroupView, ReplicaView


def group(name: str, cap: float, n: int = 1, *, up: int | None = None, usd_mtok: float = 1.0,
          outstanding: tuple[float, ...] = (), lo: int | None = None, hi: int | None = None) -> GroupView:
    up = n if up is None else up
    reps = tuple(ReplicaView(index=i, up=i < up, starting=i >= up,
                             outstanding_tokens=outstanding[i] if i < len(outstanding) else 0.0) for i in range(n))
    return GroupView(name=name, capacity_tokens_per_s=cap, usd_per_hour=1.0, usd_per_mtoken=usd_mtok, replicas=reps,
                     min_replicas=n if lo is None else lo, max_replicas=n if hi is None else hi, configured_replicas=n)


def test_registry_lists_builtins_and_refuses_unknowns() -> None:
    assert names("router") == ["capacity_proportional", "cost_aware", "least_outstanding_tokens"]
    assert names("autoscaler") == ["fixed", "queue_based", "replan"]
    assert names("weight_sync") == ["drain", "in_flight"]
    with pytest.raises(SpecError, match="least_outstanding_tokens"):
        make("router", "round_robin")
    with pytest.raises(SpecError, match="max_backlog_s"):
        make("router", "cost_aware", {"backlog": 3})
    with pytest.raises(SpecError, match="'drop', 'wait'"):
        make("batcher", "fifo", {"stale": "skip"})


def test_capacity_proportional_counts_stay_within_one_session_of_the_exact_share() -> None:
    r = make("router", "capacity_proportional")
    fleet = FleetView(now_s=0.0, groups=(group("a", 100.0, 2), group("b", 50.0, 1), group("c", 30.0, 3)))
    caps = {"a": 200.0, "b": 50.0, "c": 90.0}
    counts = dict.fromkeys(caps, 0)
    for n in range(1, 3401):
        g, _ = r.route(n, fleet)
        counts[g] += 1
        for name, c in caps.items():
            assert abs(counts[name] - n * c / 340.0) <= 1.0
    # replicas inside a group are filled evenly (fewest sessions first)
    assert [r.pinned("c", i) for i in range(3)] == [300, 300, 300]


def test_the_replica_choice_is_the_fewest_sessions_lowest_index_scan_whatever_the_history() -> None:
    """choose_replica keeps a heap per view (the twin asks the same view ~30,000 times per check); after any
    sequence of routes, releases and views with replicas down, it picks what a scan of the view picks."""
    import random

    from mixfleet.policies.router import Router

    rnd = random.Random(0)
    r = make("router", "capacity_proportional")
    views = [group("a", 100.0, 6, up=u) for u in (6, 4, 1)] + \
            [GroupView(**{**_fields(group("a", 100.0, 6)),
                          "replicas": tuple(ReplicaView(index=i, up=i % 2 == 1) for i in range(6))})]
    live: list[int] = []
    view = views[0]
    for step in range(3000):
        if rnd.random() < 0.02:
            view = rnd.choice(views)
        want = min(((r.pinned("a", x.index), x.index) for x in view.replicas if x.up), default=(0, None))[1]
        assert r.choose_replica(view) == want, step
        if live and rnd.random() < 0.45:
            r.release(live.pop(rnd.randrange(len(live))))
        else:
            r.route(step, FleetView(now_s=0.0, groups=(view,)))
            live.append(step)
    assert Router.choose_replica is type(r).choose_replica   # the default choice is the one tested


def test_routing_is_sticky_and_reroutes_when_the_replica_goes_away() -> None:
    r = make("router", "capacity_proportional")
    fleet = FleetView(now_s=0.0, groups=(group("a", 100.0, 2),))
    first = r.route(7, fleet)
    assert all(r.route(7, fleet) == first for _ in range(5)) and r.reroutes == 0
    reps = tuple(ReplicaView(index=i, up=i != first[1]) for i in range(2))
    down = FleetView(now_s=1.0, groups=(GroupView(**{**_fields(group("a", 100.0, 2)), "replicas": reps}),))
    moved = r.route(7, down)
    assert moved != first and r.reroutes == 1
    r.release(7)
    assert r.pinned(*moved) == 0
    assert r.route(8, FleetView(now_s=2.0, groups=(group("a", 100.0, 1, up=0),))) is None


def _fields(g: GroupView) -> dict:
    return {f.name: getattr(g, f.name) for f in dataclasses.fields(g) if f.init}


def test_least_outstanding_tokens_compares_seconds_of_work() -> None:
    r = make("router", "least_outstanding_tokens")
    fleet = FleetView(now_s=0.0, groups=(group("fast", 1000.0, 2, outstanding=(900.0, 1500.0)),
                                         group("slow", 100.0, 1, outstanding=(100.0,))))
    assert r.route(1, fleet) == ("fast", 0)          # 0.9 s of work beats 1.0 s
    raw = make("router", "least_outstanding_tokens", {"normalize_by_capacity": False})
    assert raw.route(1, fleet) == ("slow", 0)        # 100 tokens < 900 tokens


def test_cost_aware_takes_the_cheapest_group_with_headroom() -> None:
    r = make("router", "cost_aware", {"max_backlog_s": 10.0})
    cheap_full = group("cheap", 100.0, 1, usd_mtok=0.5, outstanding=(2000.0,))   # 20 s backlog
    mid = group("mid", 100.0, 1, usd_mtok=1.0, outstanding=(500.0,))             # 5 s
    dear = group("dear", 100.0, 1, usd_mtok=2.0)
    assert r.route(1, FleetView(now_s=0, groups=(cheap_full, mid, dear)))[0] == "mid"
    all_full = (cheap_full, group("mid", 100.0, 1, usd_mtok=1.0, outstanding=(1500.0,)))
    assert r.route(2, FleetView(now_s=0, groups=all_full))[0] == "mid"            # least backlogged
    with pytest.raises(SpecError, match="max_backlog_s"):
        make("router", "cost_aware", {"max_backlog_s": 0.0})


def test_fixed_autoscaler_keeps_the_plan_count() -> None:
    a = make("autoscaler", "fixed")
    assert a.target(group("g", 10.0, 3, up=1, lo=1, hi=5), 0.0) == 3


def test_queue_based_scales_up_at_once_and_down_after_the_idle_timeout() -> None:
    a = make("autoscaler", "queue_based", {"target_backlog_s": 10.0, "idle_timeout_s": 60.0})
    busy = group("g", 100.0, 2, outstanding=(2500.0, 2600.0), lo=1, hi=8)        # 5100 tokens / 1000 per replica
    assert a.target(busy, 0.0) == 6
    huge = group("g", 100.0, 2, outstanding=(1e6,), lo=1, hi=8)
    assert a.target(huge, 0.0) == 8                                               # capped at max
    idle = group("g", 100.0, 4, lo=1, hi=8)
    assert a.target(idle, 100.0) == 4                                             # surplus just began
    assert a.target(idle, 159.0) == 4
    assert a.target(idle, 160.0) == 1                                             # 60 s later: down to min
    assert a.target(busy, 161.0) == 6 and a.target(idle, 162.0) == 4              # a busy spell resets the clock


def pg(pid: int, t: float, v: int = 0, finished: int = 8, aborted: int = 0) -> PromptGroupView:
    return PromptGroupView(prompt_id=pid, finished=finished, aborted=aborted, expected=8, min_version=v,
                           completed_at_s=t if finished + aborted >= 8 else math.inf)


def test_batcher_takes_the_oldest_complete_groups_once_there_are_enough() -> None:
    b: Batcher = make("batcher", "fifo", {"prompts_per_update": 2, "samples_per_prompt": 8})
    buf = BufferView(now_s=5.0, trainer_version=3, groups=(pg(0, 3.0), pg(1, 1.0), pg(2, 2.0)))
    assert b.decide(buf).take == (1, 2)
    assert not b.decide(BufferView(now_s=5.0, trainer_version=3, groups=(pg(0, 3.0), pg(1, 0, finished=5)))).ready


def test_batcher_drops_stale_and_partial_groups_when_told() -> None:
    b = make("batcher", "fifo", {"prompts_per_update": 2, "max_staleness": 2, "stale": "drop", "partial": "drop"})
    buf = BufferView(now_s=9.0, trainer_version=5, groups=(
        pg(0, 1.0, v=2), pg(1, 2.0, v=3), pg(2, 3.0, v=4, finished=6, aborted=2), pg(3, 4.0, v=5)))
    d = b.decide(buf)
    assert d.drop == (0, 2) and d.take == (1, 3)
    keep = make("batcher", "fifo", {"prompts_per_update": 2, "partial": "keep"})
    assert keep.decide(buf).take == (0, 1)


def test_batcher_admission_bounds_staleness_under_wait() -> None:
    free = make("batcher", "fifo", {"prompts_per_update": 4, "inflight_prompts": 16})
    assert free.admit(trainer_version=0, started_prompts=100, inflight_prompts=10) == 6
    wait = make("batcher", "fifo", {"prompts_per_update": 4, "inflight_prompts": 16, "max_staleness": 1,
                                    "stale": "wait"})
    assert wait.admit(trainer_version=0, started_prompts=0, inflight_prompts=0) == 8    # (0 + 1 + 1) * 4
    assert wait.admit(trainer_version=0, started_prompts=8, inflight_prompts=8) == 0
    assert wait.admit(trainer_version=1, started_prompts=8, inflight_prompts=4) == 4


def test_weight_sync_pushes_new_versions_in_flight_or_by_drain() -> None:
    g = group("g", 1.0, 1)
    inflight, drain = make("weight_sync", "in_flight"), make("weight_sync", "drain")
    assert (inflight.decide(g, 1, 0.0).push, inflight.decide(g, 1, 0.0).drain) == (True, False)
    assert (drain.decide(g, 1, 0.0).push, drain.decide(g, 1, 0.0).drain) == (True, True)
    assert not inflight.decide(g, 0, 0.0).push                                   # not newer than what it has
    every2 = make("weight_sync", "in_flight", {"every_versions": 2})
    assert [every2.decide(g, v, 0.0).push for v in (1, 2, 3, 4)] == [False, True, False, True]
