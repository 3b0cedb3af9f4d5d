"""The cluster under a run's sampler fleet: which nodes are alive, how many replicas still fit.

A node gone from Ray (its raylet dead) takes its replicas with it at the fleet monitor's next tick
(`check_nodes`: event "node_lost" naming the node and its replicas, each replica then a "crash" and its
sessions re-routed). A replica is started only where the live nodes still have its group's accelerator
free (`room`: their units of it, less what this run's replicas of every group on that accelerator hold
or are starting with), so a request Ray could never satisfy is not left pending; a group held below its
planned size logs "shrink" (planned, now, why), once per change. At the start (`fit_planned`) the
planned replicas are fitted the same way, the trainer's units reserved.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mixfleet.runner.orchestration.fleet import GroupSpec
    from mixfleet.runner.orchestration.sampler_fleet import Replica, SamplerFleet


def live_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


def live_units(nodes: list[dict] | None = None) -> dict[str, float]:
    """Each resource's units over the live nodes of the Ray cluster."""
    total: dict[str, float] = {}
    for n in live_nodes() if nodes is None else nodes:
        for k, v in (n.get("Resources") or {}).items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


def trainer_placement(plan: str, accelerator: str, amount: float) -> dict[str, object]:
    """The trainer's placement on a cluster (`remote_trainer` keywords): one live node must carry `amount`
    of `accelerator`, else a clear refusal (a request no node can satisfy would wait forever)."""
    best = max((float((n.get("Resources") or {}).get(accelerator, 0.0)) for n in live_nodes()), default=0.0)
    if best < amount:
        raise ValueError(f"plan '{plan}' trainer.accelerator = {accelerator!r} x {amount}: no live node of the Ray "
                         f"cluster carries that many (most: {best:g}); label the trainer's node with "
                         "ray start --resources (docs/runner.md)")
    return {"accelerator": accelerator, "amount": amount}


class ClusterWatch:
    """Node loss and room for replicas, for one `SamplerFleet` (Ray actor modes only)."""

    def __init__(self, fleet: SamplerFleet) -> None:
        self.fleet = fleet
        self.lost_nodes: set[str] = set()
        self.on_node: dict[str, set[str]] = {}       # node -> "group#index" placed there and not retired
        self._shrunk: dict[str, int] = {}            # group -> the size its last "shrink" event named

    def _shrink(self, g: GroupSpec, now: int, reason: str) -> None:
        if self._shrunk.get(g.name) == now:
            return
        self._shrunk[g.name] = now
        self.fleet.ctx.event("shrink", g.name, -1, self.fleet.ctx.version, detail=json.dumps(
            {"planned": g.replicas, "now": now, "accelerator": g.accelerator, "per_replica": g.tp,
             "reason": reason}))

    def fit_planned(self, reserved: dict[str, float]) -> dict[str, int]:
        """How many of each group's planned replicas to start: the live nodes' units, less `reserved`."""
        total = live_units()
        free = dict(total)
        for acc, units in reserved.items():
            free[acc] = free.get(acc, 0.0) - units
        fit: dict[str, int] = {}
        for g in self.fleet.spec.groups:
            n = 0
            while n < g.replicas and free.get(g.accelerator, 0.0) >= g.tp:
                free[g.accelerator] -= g.tp
                n += 1
            fit[g.name] = n
            if n < g.replicas:
                self._shrink(g, n, f"the Ray cluster's live nodes hold {total.get(g.accelerator, 0.0):g} "
                                   f"{g.accelerator} ({reserved.get(g.accelerator, 0.0):g} for the trainer)")
        if not any(fit.values()):
            need = ", ".join(sorted({f"{g.accelerator} >= {g.tp}" for g in self.fleet.spec.groups}))
            raise ValueError(f"no sampler replica fits the Ray cluster: no live node has {need} free "
                             "(label nodes with ray start --resources; docs/runner.md)")
        return fit

    def placed(self, rep: Replica) -> None:
        if rep.node is not None:
            self.on_node.setdefault(rep.node, set()).add(f"{rep.group}#{rep.index}")

    def retired(self, rep: Replica) -> None:
        if rep.node is not None:
            self.on_node.get(rep.node, set()).discard(f"{rep.group}#{rep.index}")

    def check_nodes(self) -> None:
        """A node Ray no longer has: event "node_lost" naming it and the replicas it held (some may have
        been found dead by their own requests a moment before); those still up are lost ("crash")."""
        fleet = self.fleet
        try:
            alive = {n["NodeID"] for n in live_nodes()}
        except Exception:  # noqa: BLE001 - the GCS did not answer this tick: decide next tick
            return
        for node in [n for n in self.on_node if n not in alive and n not in self.lost_nodes]:
            self.lost_nodes.add(node)
            fleet.ctx.event("node_lost", detail=json.dumps({"node": node, "replicas": sorted(self.on_node[node])}))
            if fleet.weights.caches is not None:
                fleet.weights.caches.forget(node)
            for reps in fleet.replicas.values():
                for r in [r for r in reps if r.up and r.node == node]:
                    fleet.lost(r, f"node {node} lost")

    def room(self, g: GroupSpec) -> int:
        """How many more replicas of `g` the live nodes can hold now (logs "shrink" when that keeps the group
        below its planned size)."""
        fleet = self.fleet
        try:
            nodes = live_nodes()
        except Exception:  # noqa: BLE001 - no answer: no room this tick
            return 0
        per_node = [float((n.get("Resources") or {}).get(g.accelerator, 0.0)) for n in nodes]

        used = sum(o.tp * fleet.held(o.name) for o in fleet.spec.groups if o.accelerator == g.accelerator)
        room = max(0, min(int((sum(per_node) - used) // g.tp), sum(int(u // g.tp) for u in per_node)))
        capacity = fleet.held(g.name) + room
        if capacity < g.replicas:
            self._shrink(g, capacity, f"the live nodes hold {sum(per_node):g} {g.accelerator}, "
                                      f"{used:g} in use by this run")
        else:
            self._shrunk.pop(g.name, None)
        return room
