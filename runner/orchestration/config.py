"""What a real run needs beyond its plan (`RunConfig`; the plan's run settings: `run_settings(plan)`) and what
every part of a run shares (`RunContext`: the clock, the trainer version, the run log's event stream, background
tasks, one wake-up for the loops that wait).

The parts of a run (runner/orchestration/): `sampler_fleet.py` starts, watches and scales the sampler
replicas; `rollouts.py` keeps prompt-groups generating and routes every reply; `weights.py` exports and
pushes each new version; `recorder.py` writes the run log's rows; `orchestrator.py` runs the update loop.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError
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
    """What a real run needs beyond its plan (validated on construction): where it writes, how far it goes, what
    it starts from and on which machines. Nothing here is a plan setting: the episodes, the evaluation and the
    trainer's recipe are the plan's [embedded] table (costmodel/plan/planspec.py `EmbeddedPlan`, its one check),
    read through `run_settings(plan)`; a run changes one with a dotted override of its plan
    (runner/orchestration/recipe.py `prepare_run`), which the run log's plan records."""

    out_dir: Path
    updates: int = 30                          # target trainer version
    init_checkpoint: str = ""                  # HF layout checkpoint of the base policy (samplers + trainer)
    mode: str = "async"                        # "async" (the seed) | "sync" (generate, then train)
    fleet_mode: str = "embedded"               # "embedded" | "sglang" | "attach" (runner/orchestration/fleet.py)
    attach: dict[str, list[str]] = field(default_factory=dict)
    address: str | None = None                 # Ray cluster address; None: a local Ray
    resume: bool = False
    take_new_settings: bool = False            # resume: take the plan's differing embedded.* settings (logged)
    batcher_overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    ray_num_cpus: int | None = None
    allow_group_loss: bool = False             # a group that cannot start: go on without it (reported) or fail

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        w = "RunConfig"
        if self.mode not in RUN_MODES:
            raise SpecError(w, "mode", self.mode, RUN_MODES)
        if not isinstance(self.updates, int) or isinstance(self.updates, bool) or self.updates < 1:
            raise SpecError(w, "updates", self.updates, "an integer >= 1")
        if not self.init_checkpoint:
            raise SpecError(w, "init_checkpoint", self.init_checkpoint, "a Hugging Face layout checkpoint folder")
        for name in ("resume", "take_new_settings", "allow_group_loss"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(w, name, getattr(self, name), "true or false")
        if self.take_new_settings and not self.resume:
            raise SpecError(w, "take_new_settings", True, "false for a new run (it takes a resumed run's settings)")


def run_settings(plan: Plan) -> EmbeddedPlan:
    """The run settings of `plan`: its [embedded] table, the defaults for a plan without one (the one place the
    runner reads a setting from; each is checked once, by `EmbeddedPlan`)."""
    return plan.embedded or EmbeddedPlan()


def task_of(plan: Plan) -> str:
    """The task a run of `plan` trains on: its embedded.task, "" being the runner's default (`DEFAULT_TASK`)."""
    return run_settings(plan).task or DEFAULT_TASK


def check_task(name: str, options: dict[str, Any] | None = None, *, where: str = "task") -> None:
    """A registered task whose options its config takes; else a SpecError naming `where`, the value and the
    known tasks (a run refuses it before Ray or a sampler starts). The task registry is the runner's, so this
    check is here, not in the plan's."""
    from mixfleet.runner.rollout.tasks import task_config, task_names

    if name not in task_names():
        raise SpecError(where, "task", name, task_names())
    if not isinstance(options or {}, dict):
        raise SpecError(where, "task_options", options, "a table of the task's options")
    try:
        task_config(name, **(options or {}))
    except (TypeError, ValueError) as e:
        raise SpecError(where, "task_options", options, f"the options of task {name!r} ({e})") from None


def check_plan_task(plan: Plan) -> None:
    """`check_task` of the plan's own task and options, named as the plan's field; and its sandbox pool's cap
    declared once (`plan_sandbox`: a repo plan's [sandbox] max_live is its task_options.sandboxes)."""
    from mixfleet.costmodel.plan.planspec import plan_sandbox

    emb = run_settings(plan)
    check_task(task_of(plan), emb.task_options, where=f"plan '{plan.name}' embedded")
    plan_sandbox(plan)


class RunContext:
    """Shared by the parts of one run. The clock is the run clock: wall seconds since the run started
    (a resumed run continues from its checkpoint's `elapsed_s`, see `continue_clock`)."""

    def __init__(self, config: RunConfig, settings: EmbeddedPlan,
                 on_event: Callable[[EventRecord], Any] | None = None) -> None:
        self.config = config
        self.settings = settings                      # the plan's run settings (`run_settings(plan)`)
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
