"""Autoscalers: per group, how many replicas should be live (up or cold-starting) now.

The world asks `target(group)` at a fixed interval and starts (paying the group's cold start) or
stops replicas to match. Built-ins: `fixed` (the plan's count) and `queue_based` (replicas from the
waiting work, within min/max, scaling down only after the surplus has lasted `idle_timeout_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mixfleet.costmodel.errors import SpecError
from mixfleet.policies.registry import register
from mixfleet.policies.views import GroupView


class Autoscaler:
    """Base: clamps the subclass's wish to [min, max] and holds scale-downs for `idle_timeout_s`."""

    name = "base"
    kind = "autoscaler"

    @dataclass(frozen=True, kw_only=True)
    class Config:
        interval_s: float = 30.0             # how often the world asks
        idle_timeout_s: float = 300.0        # a surplus must last this long before replicas stop

    def __init__(self, config: Config) -> None:
        self.config = config
        self._surplus_since: dict[str, float] = {}

    def wish(self, group: GroupView, now_s: float) -> int:
        raise NotImplementedError

    def target(self, group: GroupView, now_s: float) -> int:
        """Replicas the group should have live (up or starting)."""
        want = min(max(self.wish(group, now_s), group.min_replicas), group.max_replicas)
        live = group.live_replicas
        if want >= live:
            self._surplus_since.pop(group.name, None)
            return want
        since = self._surplus_since.setdefault(group.name, now_s)
        return want if now_s - since >= self.config.idle_timeout_s else live


def _check_base(where: str, cfg: Autoscaler.Config) -> None:
    if not cfg.interval_s > 0:
        raise SpecError(where, "interval_s", cfg.interval_s, "> 0")
    if cfg.idle_timeout_s < 0:
        raise SpecError(where, "idle_timeout_s", cfg.idle_timeout_s, ">= 0")


@register("autoscaler", "fixed")
class Fixed(Autoscaler):
    """The plan's replica count, always (replaces replicas lost to faults)."""

    @dataclass(frozen=True, kw_only=True)
    class Config(Autoscaler.Config):
        def __post_init__(self) -> None:
            _check_base("policies.autoscaler (fixed)", self)

    def wish(self, group: GroupView, now_s: float) -> int:
        return group.configured_replicas

    def target(self, group: GroupView, now_s: float) -> int:
        return min(max(group.configured_replicas, group.min_replicas), group.max_replicas)


@register("autoscaler", "queue_based")
class QueueBased(Autoscaler):
    """Enough replicas that the outstanding decode work is `target_backlog_s` seconds per replica."""

    @dataclass(frozen=True, kw_only=True)
    class Config(Autoscaler.Config):
        target_backlog_s: float = 20.0       # seconds of outstanding work one replica should hold

        def __post_init__(self) -> None:
            _check_base("policies.autoscaler (queue_based)", self)
            if not self.target_backlog_s > 0:
                raise SpecError("policies.autoscaler (queue_based)", "target_backlog_s", self.target_backlog_s, "> 0")

    def wish(self, group: GroupView, now_s: float) -> int:
        per_replica = group.capacity_tokens_per_s * self.config.target_backlog_s
        return math.ceil(group.outstanding_tokens / per_replica)
