"""Routers: new session -> (group, replica), session-sticky so a multi-turn episode keeps its KV cache.

The base class keeps the bookkeeping (which session is pinned where, how many sessions each replica
holds, re-routing when a pinned replica went away); a subclass only picks a group and, if it wants,
a replica. Built-ins: `capacity_proportional` (the seed's), `least_outstanding_tokens`, `cost_aware`.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass

from mixfleet.costmodel.errors import SpecError
from mixfleet.policies.registry import register
from mixfleet.policies.views import FleetView, GroupView

Route = tuple[str, int]  # (group name, replica index)


class Router:
    """Base: sticky routing. Subclasses implement `choose_group` (and may override `choose_replica`)."""

    name = "base"
    kind = "router"
    uses_load = True   # False: decisions read only capacities and up-states (the world may reuse a view)

    @dataclass(frozen=True, kw_only=True)
    class Config:
        pass

    def __init__(self, config: Config) -> None:
        self.config = config
        self._pins: dict[int, Route] = {}
        self._pinned: Counter[Route] = Counter()
        # per group: (the view, a heap of its up replicas' (sessions, index), their indices): choose_replica's
        self._heaps: dict[str, tuple[GroupView, list[tuple[int, int]], set[int]]] = {}
        self.reroutes = 0  # sessions moved because their replica went away

    # ---- the decision (subclasses) ---------------------------------------------------------------
    def choose_group(self, fleet: FleetView) -> GroupView | None:
        raise NotImplementedError

    def choose_replica(self, group: GroupView) -> int | None:
        """Default: the up replica holding the fewest sessions (ties: lowest index).

        The same view is asked again and again (a world whose router reads no load reuses it), so per group the
        up replicas' (sessions, index) stay in a heap built for that view; a change of a replica's count pushes
        its new entry, and entries whose count is no longer the replica's are dropped when they reach the top
        (the minimum is the same as a scan of the view's replicas)."""
        name, get = group.name, self._pinned.get
        held = self._heaps.get(name)
        if held is None or held[0] is not group:
            ups = {r.index for r in group.replicas if r.up}
            heap = [(get((name, i), 0), i) for i in ups]
            heapq.heapify(heap)
            held = self._heaps[name] = (group, heap, ups)
        heap = held[1]
        while heap:
            n, i = heap[0]
            if get((name, i), 0) == n:
                return i
            heapq.heappop(heap)
        return None

    def _count(self, route: Route, delta: int) -> None:
        """A replica's pinned sessions change: its new entry into its group's heap (`choose_replica`)."""
        n = self._pinned[route] + delta
        self._pinned[route] = n
        held = self._heaps.get(route[0])
        if held is not None and route[1] in held[2]:
            heap = held[1]
            heapq.heappush(heap, (n, route[1]))
            if len(heap) > 4 * len(held[2]) + 64:   # mostly stale entries: rebuild from the counts
                get = self._pinned.get
                heap[:] = [(get((route[0], i), 0), i) for i in held[2]]
                heapq.heapify(heap)

    # ---- bookkeeping (callers) -------------------------------------------------------------------
    def route(self, session_id: int, fleet: FleetView) -> Route | None:
        """The session's replica: its pinned one while that is up, else a new choice (None: nothing up)."""
        pin = self._pins.get(session_id)
        if pin is not None:
            g = _find(fleet, pin[0])
            if g is not None and any(r.index == pin[1] and r.up for r in g.replicas):
                return pin
            self.release(session_id)
            self.reroutes += 1
        up = tuple(g for g in fleet.groups if g.up_replicas > 0)
        if not up:
            return None
        group = self.choose_group(FleetView(now_s=fleet.now_s, groups=up))
        if group is None:
            return None
        replica = self.choose_replica(group)
        if replica is None:
            return None
        route = (group.name, replica)
        self._pins[session_id] = route
        self._count(route, +1)
        return route

    def release(self, session_id: int) -> None:
        """The session ended (or moved): unpin it."""
        route = self._pins.pop(session_id, None)
        if route is not None:
            self._count(route, -1)

    def pinned(self, group: str, replica: int) -> int:
        return self._pinned[(group, replica)]


def _find(fleet: FleetView, name: str) -> GroupView | None:
    for g in fleet.groups:
        if g.name == name:
            return g
    return None


@register("router", "capacity_proportional")
class CapacityProportional(Router):
    """Each group gets a steady share of new sessions equal to its share of serving capacity (replicas
    up x tokens/s per replica). Smooth weighted round-robin: deterministic, and after n sessions every
    group's count is within one session of its exact share."""

    uses_load = False

    def __init__(self, config: Router.Config) -> None:
        super().__init__(config)
        self._credit: dict[str, float] = {}

    def choose_group(self, fleet: FleetView) -> GroupView | None:
        total = sum(g.capacity for g in fleet.groups)
        best = None
        for g in fleet.groups:
            c = self._credit.get(g.name, 0.0) + g.capacity
            self._credit[g.name] = c
            if best is None or c > self._credit[best.name]:
                best = g
        if best is not None:
            self._credit[best.name] -= total
        return best


@register("router", "least_outstanding_tokens")
class LeastOutstandingTokens(Router):
    """The up replica with the least outstanding work, measured in seconds (outstanding tokens over the
    replica's throughput) unless `normalize_by_capacity` is off; ties go to fewer sessions."""

    @dataclass(frozen=True, kw_only=True)
    class Config:
        normalize_by_capacity: bool = True   # compare tokens / (tokens/s) instead of raw tokens

    def _key(self, g: GroupView, r) -> tuple:
        scale = g.capacity_tokens_per_s if self.config.normalize_by_capacity else 1.0
        return (r.outstanding_tokens / scale, self._pinned[(g.name, r.index)] / scale, g.name, r.index)

    def choose_group(self, fleet: FleetView) -> GroupView | None:
        best = min(((self._key(g, r), g) for g in fleet.groups for r in g.replicas if r.up),
                   key=lambda kg: kg[0], default=None)
        return None if best is None else best[1]

    def choose_replica(self, group: GroupView) -> int | None:
        ups = [r for r in group.replicas if r.up]
        return min(ups, key=lambda r: self._key(group, r)).index if ups else None


@register("router", "cost_aware")
class CostAware(Router):
    """The cheapest group (USD per generated token) that still has headroom: its outstanding work per
    up replica is under `max_backlog_s` seconds. With no headroom anywhere, the least backlogged group."""

    @dataclass(frozen=True, kw_only=True)
    class Config:
        max_backlog_s: float = 30.0          # seconds of queued decode work per replica counted as full

        def __post_init__(self) -> None:
            if not self.max_backlog_s > 0:
                raise SpecError("policies.router (cost_aware)", "max_backlog_s", self.max_backlog_s, "> 0")

    @staticmethod
    def _backlog_s(g: GroupView) -> float:
        return g.outstanding_tokens / max(g.capacity, 1e-12)

    def choose_group(self, fleet: FleetView) -> GroupView | None:
        roomy = [g for g in fleet.groups if self._backlog_s(g) < self.config.max_backlog_s]
        if roomy:
            return min(roomy, key=lambda g: (g.usd_per_mtoken, g.name))
        return min(fleet.groups, key=lambda g: (self._backlog_s(g), g.name), default=None)
