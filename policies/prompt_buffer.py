"""The prompt buffer: prompt-groups from admission to an update, the same in both worlds.

A prompt-group is one prompt's `samples_per_prompt` samples (the GRPO group). The buffer hands out
prompt ids as the batcher admits them (`admit`), collects each group's samples until its siblings are all
in (`finish` / `abort`), and once `prompts_per_update` groups are complete asks the batcher for an update
(`decide`): it pops the groups taken for training and the ones dropped (stale or partial). The twin
(twin/world.py) and the runner (runner/orchestration/) keep their own sample objects (a simulated
session, a real episode) in it; the buffer only needs each sample's oldest weight version.

Pure Python: no simpy, no torch, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from mixfleet.policies.views import BufferView, PromptGroupView

S = TypeVar("S")


@dataclass(eq=False, slots=True)
class PromptGroup(Generic[S]):
    """One prompt and its samples so far."""

    prompt_id: int
    expected: int                                  # samples per prompt
    samples: list[S] = field(default_factory=list)  # finished samples, in finishing order
    aborted: int = 0                               # samples that could not be completed
    completed_at_s: float = math.inf               # when its last sample came in

    @property
    def complete(self) -> bool:
        return len(self.samples) + self.aborted >= self.expected


class PromptBuffer(Generic[S]):
    """Prompt-groups in flight and complete, and the batcher's two decisions over them.

    `sample_min_version(sample)` gives the oldest weight version a sample's tokens were drawn with (None:
    no token carries a version; the trainer's version stands in). Counters: `started` prompt ids handed out
    so far (the next id), `taken` prompts handed to the trainer in updates, `lost` prompts started that no
    update will ever train (dropped groups; groups in flight or buffered when the run was killed). The
    batcher's admission counts the prompts that are or will be trained, `started - lost`: a prompt lost is
    not in flight, and under `stale = "wait"` it must not hold a place under the staleness bound.
    """

    def __init__(self, batcher: Any, sample_min_version: Callable[[S], int | None]) -> None:
        self.batcher = batcher
        self._min_version = sample_min_version
        self.started = 0
        self.taken = 0
        self.lost = 0
        self.inflight: dict[int, PromptGroup[S]] = {}
        self.complete: dict[int, PromptGroup[S]] = {}

    @property
    def prompts_per_update(self) -> int:
        return self.batcher.config.prompts_per_update

    @property
    def samples_per_prompt(self) -> int:
        return self.batcher.config.samples_per_prompt

    # ---- admission -------------------------------------------------------------------------------------
    def admit(self, trainer_version: int) -> list[PromptGroup[S]]:
        """New prompt-groups to start now, as many as the batcher admits; they are in flight from here."""
        n = self.batcher.admit(trainer_version, self.started - self.lost, len(self.inflight))
        spp = self.samples_per_prompt
        out = []
        for _ in range(n):
            p: PromptGroup[S] = PromptGroup(prompt_id=self.started, expected=spp)
            self.started += 1
            self.inflight[p.prompt_id] = p
            out.append(p)
        return out

    # ---- samples coming in -----------------------------------------------------------------------------
    def finish(self, p: PromptGroup[S], sample: S, now_s: float) -> bool:
        """A sample of `p` finished; True when that completed the group (it is then in `complete`)."""
        p.samples.append(sample)
        return self._maybe_complete(p, now_s)

    def abort(self, p: PromptGroup[S], now_s: float) -> bool:
        """A sample of `p` could not be completed; True when that completed the group."""
        p.aborted += 1
        return self._maybe_complete(p, now_s)

    def _maybe_complete(self, p: PromptGroup[S], now_s: float) -> bool:
        if not p.complete or p.prompt_id not in self.inflight:
            return False
        p.completed_at_s = now_s
        del self.inflight[p.prompt_id]
        self.complete[p.prompt_id] = p
        return True

    # ---- the trainer's side ----------------------------------------------------------------------------
    @property
    def can_decide(self) -> bool:
        """Enough complete groups for an update (the batcher is asked only then)."""
        return len(self.complete) >= self.prompts_per_update

    def view(self, now_s: float, trainer_version: int) -> BufferView:
        def min_version(p: PromptGroup[S]) -> int:
            vs = [v for v in map(self._min_version, p.samples) if v is not None]
            return min(vs) if vs else trainer_version

        return BufferView(now_s=now_s, trainer_version=trainer_version, groups=tuple(
            PromptGroupView(prompt_id=p.prompt_id, finished=len(p.samples), aborted=p.aborted, expected=p.expected,
                            min_version=min_version(p), completed_at_s=p.completed_at_s)
            for p in self.complete.values()))

    def decide(self, now_s: float, trainer_version: int) -> tuple[list[PromptGroup[S]] | None, list[PromptGroup[S]]]:
        """(the next update's groups or None, the groups dropped now); both leave the buffer."""
        if not self.can_decide:
            return None, []
        decision = self.batcher.decide(self.view(now_s, trainer_version))
        dropped = [self.complete.pop(pid) for pid in decision.drop]
        self.lost += len(dropped)
        if not decision.ready:
            return None, dropped
        batch = [self.complete.pop(pid) for pid in decision.take]
        self.taken += len(batch)
        return batch, dropped

    # ---- resume ----------------------------------------------------------------------------------------
    def state(self) -> dict[str, int]:
        """What a checkpoint keeps (JSON-ready)."""
        return {"started_prompts": self.started, "taken_prompts": self.taken}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's `state()`: prompt ids go on from there; every prompt not trained by
        then is lost (what was in flight or buffered died with the run). A checkpoint written before
        `taken_prompts` was kept has `version` updates of `prompts_per_update` each."""
        self.started = int(state.get("started_prompts", 0))
        self.taken = int(state.get("taken_prompts", int(state.get("version", 0)) * self.prompts_per_update))
        self.lost = self.started - self.taken
        self.inflight.clear()
        self.complete.clear()
