"""Tasks by name: the registry the runner, the demonstrations and the CLI look tasks up in.

`make_task("guess", n_max=64)` returns a fresh Task (one per episode); options are the fields of
the task's config dataclass, refused with the list of known ones otherwise. `register_task` adds a
task class (a subclass of Task with a `Config` dataclass) under its `name`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mixfleet.runner.rollout.tasks.base import (
    EVAL_SEED_START,
    SPLITS,
    StepResult,
    Task,
    ToolCall,
    is_general,
    split_of,
    split_seeds,
    unknown_tool_message,
)
from mixfleet.runner.rollout.tasks.calc import CalcTask
from mixfleet.runner.rollout.tasks.guess import GuessTask
from mixfleet.runner.rollout.tasks.repo import RepoTask

TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Add a task class to the registry under `cls.name` (usable as a decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: a task class needs a non-empty `name`")
    if cls.name in TASKS and TASKS[cls.name] is not cls:
        raise ValueError(f"task name {cls.name!r} is already registered by {TASKS[cls.name].__name__}")
    TASKS[cls.name] = cls
    return cls


def task_names() -> tuple[str, ...]:
    return tuple(sorted(TASKS))


def task_config(name: str, **options: Any) -> Any:
    """The config dataclass of task `name` built from `options` (errors name the field and the allowed)."""
    if name not in TASKS:
        raise ValueError(f"task: {name!r} is not one of {', '.join(task_names())}")
    config_cls = TASKS[name].Config
    known = {f.name for f in dataclasses.fields(config_cls)}
    for key in options:
        if key not in known:
            raise ValueError(f"task {name!r}: unknown option {key!r}; known: {', '.join(sorted(known))}")
    return config_cls(**options)


def make_task(name: str, **options: Any) -> Task:
    """A fresh task instance (call `reset(seed)` / `areset(seed)` before stepping it)."""
    config = task_config(name, **options)
    return TASKS[name](config)  # type: ignore[call-arg]


register_task(GuessTask)
register_task(CalcTask)
register_task(RepoTask)

__all__ = ["EVAL_SEED_START", "SPLITS", "TASKS", "CalcTask", "GuessTask", "RepoTask", "StepResult", "Task", "ToolCall",
           "is_general", "make_task", "register_task", "split_of", "split_seeds", "task_config", "task_names",
           "unknown_tool_message"]
