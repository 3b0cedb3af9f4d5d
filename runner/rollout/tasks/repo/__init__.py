"""The `repo` task family: sandboxed bash + submit on small repositories (generated, or a task set of your own).

generator.py makes the repositories (one injected bug, the train / held-out split), taskset.py loads a task-set
folder, task.py is the RepoTask on the Task interface. docs/tasks.md describes all three.
"""

from mixfleet.runner.rollout.tasks.repo.generator import BUG_KINDS, RepoProblem, generate, split_kinds
from mixfleet.runner.rollout.tasks.repo.task import RepoConfig, RepoTask, clip_output, pool_stats, shared_pool
from mixfleet.runner.rollout.tasks.repo.taskset import RepoSpec, TaskSetError, load_task, load_task_set

__all__ = ["BUG_KINDS", "RepoConfig", "RepoProblem", "RepoSpec", "RepoTask", "TaskSetError", "clip_output",
           "generate", "load_task", "load_task_set", "pool_stats", "shared_pool", "split_kinds"]
