"""Spot accounting: what preemptions are expected to cost a candidate mix per update.

Spot capacity (`PlannerConfig.spot`): each named accelerator with a spot price in the price table
(`Catalog.spot`) also offers its groups as spot groups (`-SPOT`, `GroupPlan.spot`), priced at the spot price and
preempted at the catalog's rate (or `spot_preemptions_per_hour`). The screen discounts a spot replica's
throughput by the share of its time a preemption costs (`GroupType.loss_share`, planner/fleet.py `type_from`: the
replacement's cold start and weight load, plus the work in flight as the plan's `on_loss` treats it: "restart"
regenerates its running trajectories so far, "resume" re-prefills their contexts); `expected_lost_work` gives the
plan's preemptions, lost replica-seconds and USD per update; the twin simulates the preemptions (the one fault
process, `[faults]`), and `PlanResult.on_demand` is the best mix without spot groups beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mixfleet.planner.config import PlannerConfig
    from mixfleet.planner.fleet import GroupType
    from mixfleet.planner.search import Candidate


def expected_lost_work(c: Candidate, types: list[GroupType], cfg: PlannerConfig) -> dict[str, Any]:
    """What preemptions are expected to cost the candidate per update (the screen's model, `type_from`): the
    preemptions (replicas x rate x time per update), the replica-seconds they lose (each: the replacement's cold
    start and weight load plus the work in flight as `cfg.on_loss` treats it), that as a share of the fleet's
    replica-seconds, and the USD those lost seconds were billed. The time per update is the twin's when the
    candidate was verified, else the screen's."""
    by = {t.name: t for t in types}
    t_update = c.verified.get("time_per_update_s", c.time_per_update_s) if c.verified else c.time_per_update_s
    pre = lost_s = usd = 0.0
    reps = 0
    for g, r in c.replicas.items():
        t = by[g]
        reps += r
        events = r * t.preemptions_per_hour * t_update / 3600.0
        pre += events
        lost_s += events * (t.replace_s + t.inflight_loss_s)
        usd += events * (t.replace_s + t.inflight_loss_s) * t.usd_per_hour / 3600.0
    spot = {g: r for g, r in c.replicas.items() if by[g].spot}
    return {"on_loss": cfg.on_loss, "spot_replicas": spot, "preemptions_per_update": pre,
            "lost_replica_s_per_update": lost_s, "lost_share": lost_s / max(reps * t_update, 1e-12),
            "lost_usd_per_update": usd, "time_per_update_s": t_update}

