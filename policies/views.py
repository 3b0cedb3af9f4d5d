"""Read-only snapshots that policies decide on: the fleet (groups, replicas) and the update buffer.

Both worlds build these: the twin from its simulated replicas, the runner from its live samplers.
They are frozen, hold plain numbers, and carry the time they were taken (`now_s`), so a policy
never reads a clock or reaches into either world's internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaView:
    """One sampler replica of a group."""
    index: int                       # replica number within its group (stable for its lifetime)
    up: bool                         # serving (False while cold-starting, syncing by drain, or dead)
    starting: bool = False           # cold start under way
    outstanding_tokens: float = 0.0  # tokens still to decode for running + waiting requests
    running: int = 0                 # requests in the batch now
    waiting: int = 0                 # requests queued (KV full)
    sessions: int = 0                # sessions pinned to this replica (sticky)
    busy_s: float = 0.0              # serving time so far (for utilization)
    idle_since_s: float | None = None  # when it last became empty (None while busy)


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupView:
    """One (accelerator, precision) group and its replicas."""
    name: str
    capacity_tokens_per_s: float     # one replica's serving throughput (cost model, nominal batch)
    usd_per_hour: float              # one replica's price (all its GPUs)
    usd_per_mtoken: float            # price per generated million tokens at nominal throughput
    replicas: tuple[ReplicaView, ...]
    min_replicas: int
    max_replicas: int
    configured_replicas: int         # the plan's replica count
    cold_start_s: float = 0.0
    weight_version: int = 0          # newest weights loaded on this group
    up_replicas: int = field(init=False, repr=False, compare=False)  # replicas up (counted once: routers ask often)

    def __post_init__(self) -> None:
        object.__setattr__(self, "up_replicas", sum(1 for r in self.replicas if r.up))

    @property
    def live_replicas(self) -> int:
        """Replicas up or starting (what the autoscaler has asked for)."""
        return sum(1 for r in self.replicas if r.up or r.starting)

    @property
    def capacity(self) -> float:
        """Serving capacity of the replicas up now, tokens/s."""
        return self.capacity_tokens_per_s * self.up_replicas

    @property
    def outstanding_tokens(self) -> float:
        return sum(r.outstanding_tokens for r in self.replicas)


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetView:
    """All groups at time `now_s`."""
    now_s: float
    groups: tuple[GroupView, ...]

    def group(self, name: str) -> GroupView:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptGroupView:
    """A prompt's samples as the buffer holds them."""
    prompt_id: int
    finished: int                    # samples that finished (any reason but aborted)
    aborted: int                     # samples that could not be completed
    expected: int                    # samples per prompt
    min_version: int                 # oldest weight version any of its samples started on
    completed_at_s: float            # when its last sample finished (inf while incomplete)

    @property
    def complete(self) -> bool:
        return self.finished + self.aborted >= self.expected


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferView:
    """The prompt-groups waiting for the trainer, oldest completion first."""
    now_s: float
    trainer_version: int             # the version the next update trains from
    groups: tuple[PromptGroupView, ...]
