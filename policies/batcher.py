"""The update batcher: when the completed prompt-groups form an update, and which ones it drops.

An update is `prompts_per_update` prompts x `samples_per_prompt` samples (the seed: 128 x 8). The
world keeps up to `inflight_prompts` prompts generating (fully asynchronous: the samplers never wait
for the trainer). Optional `max_staleness` (trainer version minus the oldest weights a prompt's
samples started on): `stale = "drop"` discards prompt-groups beyond it, `stale = "wait"` stops
starting new prompts that could end up beyond it (the trainer catches up first). Prompt-groups with
aborted samples are trained on their finished samples (`partial = "keep"`) or dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.limits import (
    MAX_INFLIGHT_PROMPTS,
    MAX_PROMPTS_PER_UPDATE,
    MAX_SAMPLES_PER_PROMPT,
    MAX_STALENESS,
    MAX_TRAJECTORIES_IN_FLIGHT,
    MAX_TRAJECTORIES_PER_UPDATE,
    check_count,
    check_product,
)
from mixfleet.policies.registry import register
from mixfleet.policies.views import BufferView

STALE_ACTIONS = ("drop", "wait")
PARTIAL_ACTIONS = ("keep", "drop")


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchDecision:
    take: tuple[int, ...] = ()       # prompt ids forming the next update (empty: not ready)
    drop: tuple[int, ...] = ()       # prompt ids discarded (stale or partial)

    @property
    def ready(self) -> bool:
        return bool(self.take)


@register("batcher", "fifo")
class Batcher:
    """Oldest-completed first; the two decisions are `decide` (form an update) and `admit` (start prompts)."""

    name = "fifo"
    kind = "batcher"

    @dataclass(frozen=True, kw_only=True)
    class Config:
        prompts_per_update: int = 128        # prompts per trainer update
        samples_per_prompt: int = 8          # samples (trajectories) per prompt, the GRPO group
        inflight_prompts: int = 512          # prompts kept generating at once (sets the staleness)
        max_staleness: int | None = None     # versions; None = unlimited (the seed)
        stale: str = "drop"                  # "drop" | "wait"
        partial: str = "keep"                # "keep" | "drop" prompt-groups with aborted samples

        def __post_init__(self) -> None:
            w = "policies.batcher"
            for f, hi in (("prompts_per_update", MAX_PROMPTS_PER_UPDATE),
                          ("samples_per_prompt", MAX_SAMPLES_PER_PROMPT), ("inflight_prompts", MAX_INFLIGHT_PROMPTS)):
                check_count(w, f, getattr(self, f), 1, hi)
            spp = self.samples_per_prompt
            check_product(w, "prompts_per_update x samples_per_prompt", self.prompts_per_update * spp,
                          MAX_TRAJECTORIES_PER_UPDATE)
            check_product(w, "inflight_prompts x samples_per_prompt", self.inflight_prompts * spp,
                          MAX_TRAJECTORIES_IN_FLIGHT)
            if self.max_staleness is not None:
                check_count(w, "max_staleness", self.max_staleness, 0, MAX_STALENESS, " (omit for unlimited)")
            if self.stale not in STALE_ACTIONS:
                raise SpecError(w, "stale", self.stale, STALE_ACTIONS)
            if self.partial not in PARTIAL_ACTIONS:
                raise SpecError(w, "partial", self.partial, PARTIAL_ACTIONS)

    def __init__(self, config: Config) -> None:
        self.config = config

    @property
    def trajectories_per_update(self) -> int:
        return self.config.prompts_per_update * self.config.samples_per_prompt

    def decide(self, buffer: BufferView) -> BatchDecision:
        """Take the oldest `prompts_per_update` usable complete prompt-groups, if there are enough."""
        c = self.config
        take: list[int] = []
        drop: list[int] = []
        for g in sorted((g for g in buffer.groups if g.complete), key=lambda g: (g.completed_at_s, g.prompt_id)):
            stale = c.max_staleness is not None and buffer.trainer_version - g.min_version > c.max_staleness
            if g.finished == 0 or (stale and c.stale == "drop") or (g.aborted and c.partial == "drop"):
                drop.append(g.prompt_id)
            elif len(take) < c.prompts_per_update:
                take.append(g.prompt_id)
        if len(take) < c.prompts_per_update:
            take = []
        return BatchDecision(take=tuple(take), drop=tuple(drop))

    def admit(self, trainer_version: int, started_prompts: int, inflight_prompts: int) -> int:
        """How many new prompts to start now. Under `stale = "wait"`, prompt number n (0-based) starts
        only once the trainer is at a version from which it cannot exceed `max_staleness`."""
        c = self.config
        room = max(0, c.inflight_prompts - inflight_prompts)
        if c.max_staleness is not None and c.stale == "wait":
            bound = (trainer_version + c.max_staleness + 1) * c.prompts_per_update
            room = min(room, max(0, bound - started_prompts))
        return room
