"""A real run's settings (`RunConfig`) and what every part of a run shares (`RunContext`: the clock, the
trainer version, the run log's event stream, background tasks, one wake-up for the loops that wait).

The parts of a run (runner/orchestration/): `sampler_fleet.py` starts, watches and scales the sampler
replicas; `rollouts.py` keeps prompt-groups generating and routes every reply; `weights.py` exports and
pushes each new version; `recorder.py` writes the run log's rows; `orchestrator.py` runs the update loop.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.costmodel.runlog import EventRecord, RunLogWriter
from mixfleet.policies.plan import Plan

RUN_MODES = ("async", "sync")
STATE_DIR = "trainer_state"
WEIGHTS_DIR = "weights"
ORCH_STATE_FILE = "orchestrator.json"


MAX_SAME_REPLICA_RETRIES = 3       # per session: resends to a live replica after a dropped connection


class RunFailed(RuntimeError):
    """The run cannot go on (e.g. a sampler group none of whose replicas can start); the message says why
    and what to change. The run log is closed "failed" with its last checkpoint."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a real run needs beyond the plan (validated on construction)."""

    out_dir: Path
    updates: int = 30                          # target trainer version
    init_checkpoint: str = ""                  # HF layout checkpoint of the base policy (samplers + trainer)
    mode: str = "async"                        # "async" (the seed) | "sync" (generate, then train)
    fleet_mode: str = "embedded"               # "embedded" | "sglang" | "attach" (runner/orchestration/fleet.py)
    attach: dict[str, list[str]] = field(default_factory=dict)
    address: str | None = None                 # Ray cluster address; None: a local Ray
    resume: bool = False
    task: str = "guess"
    task_options: dict[str, Any] = field(default_factory=dict)
    max_turns: int | None = None               # None: the plan's embedded.max_turns
    max_new_tokens: int | None = None          # None: the plan's embedded.max_new_tokens
    temperature: float | None = None
    top_k_record: int = 16                     # top-K log-probs recorded per sampled token (corrections' head)
    lr: float = 1e-4
    lr_warmup_steps: int = 0                   # linear warm-up of the learning rate over the first updates
    grad_clip_norm: float = 1.0
    loss_agg: str = "token_mean"               # token_mean | seq_mean_token_mean (CorrectionConfig.loss_agg)
    advantage_std: bool = False                # GRPO advantages divided by their prompt-group's std
    trainer_threads: int = 1
    sampler_threads: int | None = None         # None: the plan's embedded.threads_per_replica
    eval_every: int | None = None              # None: the plan's embedded.eval_every (0 = never)
    eval_problems: int = 8
    pass_k: int | None = None
    eval_at_start: bool = True
    batcher_overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    ray_num_cpus: int | None = None
    allow_group_loss: bool = False             # a group that cannot start: go on without it (reported) or fail
    replan_solver: Callable[..., Any] | None = None  # the `replan` autoscaler's solver (policies.replan.Solver;
                                               # `mixfleet run` hands the twin's, twin.replan.solver_for)

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.mode not in RUN_MODES:
            raise ValueError(f"RunConfig.mode = {self.mode!r}; allowed: {', '.join(RUN_MODES)}")
        if not isinstance(self.updates, int) or self.updates < 1:
            raise ValueError(f"RunConfig.updates = {self.updates!r}; allowed: an integer >= 1")
        if not self.init_checkpoint:
            raise ValueError("RunConfig.init_checkpoint: required (a Hugging Face layout checkpoint folder)")
        for name in ("top_k_record", "trainer_threads", "eval_problems"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "top_k_record" else 1):
                lo = 0 if name == "top_k_record" else 1
                raise ValueError(f"RunConfig.{name} = {v!r}; allowed: an integer >= {lo}")
        if not self.lr > 0:
            raise ValueError(f"RunConfig.lr = {self.lr!r}; allowed: > 0")
        if not isinstance(self.lr_warmup_steps, int) or isinstance(self.lr_warmup_steps, bool) \
                or self.lr_warmup_steps < 0:
            raise ValueError(f"RunConfig.lr_warmup_steps = {self.lr_warmup_steps!r}; allowed: an integer >= 0")
        from mixfleet.runner.corrections.loss import LOSS_AGGS

        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"RunConfig.loss_agg = {self.loss_agg!r}; allowed: {', '.join(LOSS_AGGS)}")
        if not isinstance(self.advantage_std, bool):
            raise ValueError(f"RunConfig.advantage_std = {self.advantage_std!r}; allowed: true or false")
        if self.task:                              # "" = the plan's [embedded] task (checked when the run starts)
            check_task(self.task, self.task_options, where="RunConfig.task")

    @classmethod
    def for_plan(cls, plan: Plan, **kw: Any) -> RunConfig:
        """A RunConfig from the plan's `[embedded.extra]` runner settings (e.g. lr, trainer_threads,
        eval_problems, top_k_record), then `kw` (explicit arguments win; None values are ignored)."""
        settable = {"lr", "lr_warmup_steps", "loss_agg", "advantage_std", "grad_clip_norm", "trainer_threads",
                    "sampler_threads", "eval_problems", "top_k_record",
                    "task_options", "max_turns", "max_new_tokens", "temperature", "eval_at_start"}
        extra = dict((plan.embedded.extra if plan.embedded is not None else {}) or {})
        for key in extra:
            if key not in settable:
                raise ValueError(f"plan '{plan.name}' [embedded.extra]: unknown runner setting {key!r}; "
                                 f"allowed: {', '.join(sorted(settable))}")
        extra.update({k: v for k, v in kw.items() if v is not None})
        return cls(**extra)


def check_task(name: str, options: dict[str, Any] | None = None, *, where: str = "task") -> None:
    """A registered task whose options its config takes; else a ValueError naming `where`, the value and the
    known tasks (a run refuses it before Ray or a sampler starts)."""
    from mixfleet.runner.rollout.tasks import task_config, task_names

    if name not in task_names():
        raise ValueError(f"{where} = {name!r}; allowed: {', '.join(task_names())}")
    if not isinstance(options or {}, dict):
        raise ValueError(f"{where} {name!r}: task_options = {options!r}; allowed: a table of the task's options")
    task_config(name, **(options or {}))



class RunContext:
    """Shared by the parts of one run. The clock is the run clock: wall seconds since the run started
    (a resumed run continues from its checkpoint's `elapsed_s`, see `continue_clock`)."""

    def __init__(self, config: RunConfig, on_event: Callable[[EventRecord], Any] | None = None) -> None:
        self.config = config
        self.out: Path = config.out_dir
        self.on_event = on_event
        self.writer: RunLogWriter | None = None
        self.version = 0                              # the trainer's newest version
        self.stopping = False
        self.wake = asyncio.Event()                   # set when something a waiting loop may act on changed
        self._tasks: set[asyncio.Task] = set()
        self._t0 = time.monotonic()
        self.fatal: RunFailed | None = None           # set by a part that found the run cannot go on

    def fail(self, error: RunFailed) -> None:
        """The run cannot go on: the trainer's loop raises `error` at its next wait (the run log closes
        "failed", its last checkpoint kept)."""
        if self.fatal is None:
            self.fatal = error
        self.wake.set()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def continue_clock(self, elapsed_s: float) -> None:
        self._t0 = time.monotonic() - elapsed_s

    def event(self, kind: str, group: str = "", replica: int = -1, version: int = -1, detail: str = "",
              duration_s: float = math.nan) -> None:
        rec = EventRecord(time_s=self.now(), kind=kind, group=group, replica=replica, version=version,
                          detail=detail, duration_s=duration_s)
        if self.writer is not None:
            self.writer.append(rec)
        if self.on_event is not None:
            self.on_event(rec)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """A background task of the run (cancelled by `cancel_tasks` when the run stops)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_tasks(self) -> None:
        self.stopping = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def wait_wake(self, timeout_s: float = 0.5) -> None:
        """Wait for the next `wake.set()` (or `timeout_s`)."""
        self.wake.clear()
        try:
            await asyncio.wait_for(self.wake.wait(), timeout=timeout_s)
        except TimeoutError:
            pass
