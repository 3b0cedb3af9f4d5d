"""A real run's settings (`RunConfig`) and what every part of a run shares (`RunContext`: the clock, the
trainer version, the run log's event stream, background tasks, one wake-up for the loops that wait).

The parts of a run (runner/orchestration/): `sampler_fleet.py` starts, watches and scales the sampler
replicas; `rollouts.py` keeps prompt-groups generating and routes every reply; `weights.py` exports and
pushes each new version; `recorder.py` writes the run log's rows; `orchestrator.py` runs the update loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.costmodel.records.runlog import EventRecord, RunLogWriter
from mixfleet.policies.plan import EmbeddedPlan, Plan

RUN_MODES = ("async", "sync")
DEFAULT_TASK = "guess"                      # the task of a plan that names none
STATE_DIR = "trainer_state"
WEIGHTS_DIR = "weights"
ORCH_STATE_FILE = "orchestrator.json"


MAX_SAME_REPLICA_RETRIES = 3       # per session: resends to a live replica after a dropped connection


class RunFailed(RuntimeError):
    """The run cannot go on (e.g. a sampler group none of whose replicas can start); the message says why
    and what to change. The run log is closed "failed" with its last checkpoint."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a real run needs beyond the plan (validated on construction).

    The plan's run settings (its [embedded] table, costmodel/plan/planspec.py `EmbeddedPlan`: the episodes, the
    evaluation, the trainer's recipe) are owned by the plan. The fields below of the same names (`PLAN_SETTINGS`)
    are this run's overrides: None is the plan's value, anything else (0 and false included) this run's, merged
    once by `resolved(plan)`, which the orchestrator calls before anything reads them."""

    out_dir: Path
    updates: int = 30                          # target trainer version
    init_checkpoint: str = ""                  # HF layout checkpoint of the base policy (samplers + trainer)
    mode: str = "async"                        # "async" (the seed) | "sync" (generate, then train)
    fleet_mode: str = "embedded"               # "embedded" | "sglang" | "attach" (runner/orchestration/fleet.py)
    attach: dict[str, list[str]] = field(default_factory=dict)
    address: str | None = None                 # Ray cluster address; None: a local Ray
    resume: bool = False
    batcher_overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    ray_num_cpus: int | None = None
    allow_group_loss: bool = False             # a group that cannot start: go on without it (reported) or fail
    # overrides of the plan's [embedded] settings (None: the plan's; see EmbeddedPlan for each one's meaning)
    task: str | None = None                    # the plan's "" is the runner's default task, "guess"
    task_options: dict[str, Any] | None = None
    max_turns: int | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k_record: int | None = None
    lr: float | None = None
    lr_warmup_steps: int | None = None
    grad_clip_norm: float | None = None
    loss_agg: str | None = None
    advantage_std: bool | None = None
    trainer_threads: int | None = None
    threads_per_replica: int | None = None     # torch threads of one embedded sampler
    eval_every: int | None = None              # 0 = never
    eval_problems: int | None = None
    pass_k: int | None = None
    eval_top_p: float | None = None
    eval_at_start: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.mode not in RUN_MODES:
            raise ValueError(f"RunConfig.mode = {self.mode!r}; allowed: {', '.join(RUN_MODES)}")
        if not isinstance(self.updates, int) or self.updates < 1:
            raise ValueError(f"RunConfig.updates = {self.updates!r}; allowed: an integer >= 1")
        if not self.init_checkpoint:
            raise ValueError("RunConfig.init_checkpoint: required (a Hugging Face layout checkpoint folder)")
        for name, lo in (("top_k_record", 0), ("trainer_threads", 1), ("threads_per_replica", 1),
                         ("eval_problems", 1), ("lr_warmup_steps", 0), ("eval_every", 0), ("max_turns", 1),
                         ("max_new_tokens", 1), ("pass_k", 1)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
                raise ValueError(f"RunConfig.{name} = {v!r}; allowed: an integer >= {lo} (None: the plan's)")
        for name in ("lr", "grad_clip_norm", "temperature"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int | float) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"RunConfig.{name} = {v!r}; allowed: > 0 (None: the plan's)")
        from mixfleet.runner.corrections.loss import LOSS_AGGS
        from mixfleet.runner.sampler.engine_api import TOP_P_ALLOWED, valid_top_p

        if self.eval_top_p is not None and not valid_top_p(self.eval_top_p):
            raise ValueError(f"RunConfig.eval_top_p = {self.eval_top_p!r}; allowed: {TOP_P_ALLOWED} (None: the plan's)")

        if self.loss_agg is not None and self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"RunConfig.loss_agg = {self.loss_agg!r}; allowed: {', '.join(LOSS_AGGS)}")
        for name in ("advantage_std", "eval_at_start"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"RunConfig.{name} = {v!r}; allowed: true or false (None: the plan's)")
        if self.task:                              # None / "": the plan's [embedded] task (checked when the run starts)
            check_task(self.task, self.task_options, where="RunConfig.task")

    def resolved(self, plan: Plan) -> RunConfig:
        """This run's settings with every override left None taken from the plan's [embedded] table (the one merge
        of the two; an already resolved config is returned as it is)."""
        emb = plan.embedded or EmbeddedPlan()
        taken = {name: getattr(emb, name) for name in PLAN_SETTINGS if getattr(self, name) is None}
        if "task" in taken or self.task == "":
            taken["task"] = emb.task or DEFAULT_TASK
        if not taken:
            return self
        try:                                       # the plan's values checked against the runner's vocabularies
            return dataclasses.replace(self, **taken)
        except ValueError as e:
            raise ValueError(f"plan '{plan.name}' [embedded] ({', '.join(sorted(taken))}): {e}") from None


PLAN_SETTINGS = tuple(f.name for f in dataclasses.fields(RunConfig)
                      if f.name in {e.name for e in dataclasses.fields(EmbeddedPlan)})


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
        self.event_counts: collections.Counter[str] = collections.Counter()   # this run's events by kind

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
        self.event_counts[kind] += 1
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
