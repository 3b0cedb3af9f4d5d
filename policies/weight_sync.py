"""Weight sync: when and how new trainer weights reach each sampler group.

`in_flight`: the push (transfer + re-quantization, the cost model's weight_sync_s) happens while the
group keeps serving; when it lands, running sessions continue on the new weights from their next
token (their trajectory then spans several versions). `drain`: the group stops admitting turns,
lets its running requests finish, then loads the weights (serving paused for the load) and resumes.
Both may push only every `every_versions`-th version.
"""

from __future__ import annotations

from dataclasses import dataclass

from mixfleet.costmodel.errors import SpecError
from mixfleet.policies.registry import register
from mixfleet.policies.views import GroupView


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncDecision:
    push: bool                       # send the new version to this group now
    drain: bool = False              # stop admitting, finish running requests, then load


class WeightSync:
    """Base: pushes every `every_versions`-th version; subclasses say whether to drain."""

    name = "base"
    kind = "weight_sync"
    drains = False

    @dataclass(frozen=True, kw_only=True)
    class Config:
        every_versions: int = 1              # push when the version is a multiple of this

        def __post_init__(self) -> None:
            if not isinstance(self.every_versions, int) or self.every_versions < 1:
                raise SpecError("policies.weight_sync", "every_versions", self.every_versions, "an integer >= 1")

    def __init__(self, config: Config) -> None:
        self.config = config

    def decide(self, group: GroupView, new_version: int, now_s: float) -> SyncDecision:
        """Whether (and how) `group` gets `new_version` now."""
        push = new_version > group.weight_version and new_version % self.config.every_versions == 0
        return SyncDecision(push=push, drain=push and self.drains)


@register("weight_sync", "in_flight")
class InFlight(WeightSync):
    """Push while serving; sessions switch to the new weights mid-trajectory."""


@register("weight_sync", "drain")
class Drain(WeightSync):
    """Finish running requests, then load; no request mixes versions."""

    drains = True
