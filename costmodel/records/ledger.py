"""The update ledger: one place that turns what a world measured into the run log's `updates` and `groups` rows.

The twin (twin/world.py) and the runner (runner/orchestration/) hand it, at the end of each update, each
sampler group's running totals (`GroupTotals`: replica-seconds up, cost, busy seconds, tokens generated)
and its share of the batch (`GroupBatch`); the ledger keeps the totals of the previous update and writes
each column with one meaning in both worlds (docs/runlog.md):

- `groups.replicas_up`: mean replicas serving over the window (replica-seconds up / window seconds).
- `groups.utilization`: busy replica-seconds / up replica-seconds in the window (0 when none was up).
- `groups.cost_usd`: the group's cost in the window: its replicas, up or starting, at the plan's price.
- `updates.cost_sampler_usd` / `cost_trainer_usd`: cumulative at the update's end; the trainer is billed
  for the whole run clock at `trainer_usd_per_hour` (the plan's trainer GPUs x its price per GPU-hour).
- `updates.cost_sandbox_usd`: cumulative at the update's end, what the world's sandboxes cost so far (a world
  without sandboxes: 0); `sandbox_wait_s` / `sandbox_s`: the batch's pool waits and sandbox time, summed.
- `updates.extreme_share`: share of trained tokens with ratio outside [0.2, 5]; `extreme_low_share` /
  `extreme_high_share` split it where a world measures the split (the runner), NaN where it does not.
- `groups.kl_k3_on_policy` / `kl_k1_on_policy` / `tokens_on_policy`: over the group's staleness-0 tokens.

It also writes the `weight_push` event's detail (JSON, `weight_push_detail`). No torch, no simpy: costmodel.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixfleet.costmodel.records.runlog import GroupRecord, UpdateRecord

_NAN = math.nan
WEIGHT_PUSH_MODES = ("drain", "in_flight")


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupTotals:
    """A sampler group's running totals, from the start of the run (or of this resumed run) to now."""

    up_replica_s: float = 0.0        # replica-seconds serving
    cost_usd: float = 0.0            # its replicas' cost (up or starting), USD
    busy_s: float = 0.0              # replica-seconds generating
    tokens_generated: int = 0        # tokens it sampled


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupBatch:
    """A group's part of one update's batch and the trainer's (or the priors') metrics over its tokens."""

    samples: int = 0
    tokens_trained: int = 0
    staleness_mean: float = _NAN
    kl_k3: float = _NAN
    kl_k1: float = _NAN
    extreme_share: float = _NAN
    masked_share: float = _NAN
    kl_k3_on_policy: float = _NAN
    kl_k1_on_policy: float = _NAN
    tokens_on_policy: int = 0
    routing_token_share: float = _NAN   # MoE routing disagreement (runlog.GroupRecord)
    routing_layer_share: float = _NAN


def trainer_usd_per_hour(price_usd_per_gpu_hour: float, gpus: int) -> float:
    """What the trainer costs per hour of the run clock: its GPUs at the plan's price."""
    return gpus * price_usd_per_gpu_hour


WEIGHT_PUSH_TIMINGS = ("publish_s", "transfer_s", "load_s", "fetch_wait_s", "nodes")


def weight_push_detail(mode: str, replicas: int, loaded: int, **timings: float) -> str:
    """The `weight_push` event's detail, JSON in both worlds: the sync mode, replicas pushed to, loaded ok;
    a real run adds the version's `publish_s` (trainer -> object store, once), the group's `transfer_s` (its
    nodes' one fetch each into their cache, the slowest), `load_s` (its replicas' loads from the node-local
    folder), `fetch_wait_s` (what the group waited for its nodes' copies) and `nodes` (how many it spans)."""
    if mode not in WEIGHT_PUSH_MODES:
        raise ValueError(f"weight_push mode {mode!r}; allowed: {', '.join(WEIGHT_PUSH_MODES)}")
    unknown = sorted(set(timings) - set(WEIGHT_PUSH_TIMINGS))
    if unknown:
        raise ValueError(f"weight_push detail: unknown {', '.join(unknown)}; allowed: {', '.join(WEIGHT_PUSH_TIMINGS)}")
    return json.dumps({"mode": mode, "replicas": int(replicas), "loaded": int(loaded),
                       **{k: float(timings[k]) if k != "nodes" else int(timings[k])
                          for k in WEIGHT_PUSH_TIMINGS if k in timings}})


class Ledger:
    """Per update: the groups' window rows and the update's row. `record(...)` returns both."""

    def __init__(self, groups: list[str] | tuple[str, ...], trainer_usd_per_hour: float, *,
                 start_s: float = 0.0) -> None:
        self.groups = tuple(groups)
        self.trainer_usd_per_hour = float(trainer_usd_per_hour)
        self.last_update_s = start_s
        self.cost_before_usd = dict.fromkeys(self.groups, 0.0)   # cost of a run before its resume
        self._marks = {g: GroupTotals() for g in self.groups}

    def restart_totals(self, now_s: float) -> None:
        """A resumed run: its groups' totals start again from zero at `now_s` (new replicas); what they cost
        before is kept in `cost_before_usd`."""
        self._marks = {g: GroupTotals() for g in self.groups}
        self.last_update_s = now_s

    def record(self, *, version: int, now_s: float, start_s: float, totals: Mapping[str, GroupTotals],
               batches: Mapping[str, GroupBatch], train_step_s: float, weight_sync_s: float, tokens: int,
               trajectories: int, staleness: Mapping[str, float], cost_sandbox_usd: float = 0.0,
               **metrics: Any) -> tuple[UpdateRecord, list[GroupRecord]]:
        """The update `version` that ended at `now_s`: its `UpdateRecord` and one `GroupRecord` per group.
        `staleness`: staleness_mean/p50/p95/max; `metrics`: UpdateRecord's metric fields (kl_k1, kl_k3, ...)."""
        window = max(now_s - self.last_update_s, 1e-12)
        rows = []
        for name in self.groups:
            t, m, b = totals[name], self._marks[name], batches.get(name, GroupBatch())
            up_s = t.up_replica_s - m.up_replica_s
            rows.append(GroupRecord(
                version=version, group=name, replicas_up=up_s / window,
                utilization=min(1.0, max(0.0, (t.busy_s - m.busy_s) / up_s)) if up_s > 0 else 0.0,
                tokens_generated=int(t.tokens_generated - m.tokens_generated), samples=b.samples,
                share_of_samples=b.samples / max(trajectories, 1), kl_k3=b.kl_k3, extreme_share=b.extreme_share,
                cost_usd=t.cost_usd - m.cost_usd, kl_k1=b.kl_k1, masked_share=b.masked_share,
                staleness_mean=b.staleness_mean, tokens_trained=b.tokens_trained, kl_k3_on_policy=b.kl_k3_on_policy,
                kl_k1_on_policy=b.kl_k1_on_policy, tokens_on_policy=b.tokens_on_policy,
                routing_token_share=b.routing_token_share, routing_layer_share=b.routing_layer_share))
            self._marks[name] = t
        self.last_update_s = now_s
        update = UpdateRecord(
            version=version, start_s=start_s, end_s=now_s, train_step_s=train_step_s, weight_sync_s=weight_sync_s,
            tokens=tokens, trajectories=trajectories, **staleness,
            cost_sampler_usd=sum(self.cost_before_usd[g] + totals[g].cost_usd for g in self.groups),
            cost_trainer_usd=self.trainer_usd_per_hour * now_s / 3600.0, cost_sandbox_usd=cost_sandbox_usd, **metrics)
        return update, rows

    # ---- resume -----------------------------------------------------------------------------------------
    def state(self, totals: Mapping[str, GroupTotals]) -> dict[str, Any]:
        """JSON-ready: each group's cost so far (what a resumed run carries on from)."""
        return {"cost_usd_by_group": {g: self.cost_before_usd[g] + totals[g].cost_usd for g in self.groups}}

    def restore(self, state: Mapping[str, Any], now_s: float) -> None:
        """Carry on from `state(...)`; a checkpoint that kept only the run's total (`cost_sampler_usd`) puts
        it on the first group, so the cumulative column goes on where it was."""
        by_group = state.get("cost_usd_by_group")
        if by_group is None and self.groups:
            by_group = {self.groups[0]: state.get("cost_sampler_usd", 0.0)}
        for g, usd in (by_group or {}).items():
            if g in self.cost_before_usd:
                self.cost_before_usd[g] = float(usd)
        self.restart_totals(now_s)
