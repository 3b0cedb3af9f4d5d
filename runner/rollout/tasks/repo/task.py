"""The `repo` task: fix the issue of a small repository with `bash CMD` in a sandbox, then `submit`.

Episode (one RepoTask per episode, as every task):
- areset(seed): the repository (generator.generate(seed), or task `seed % n` of the `task_set` folder) is
  written to a temp folder, the ORIGINAL, and a sandbox (runner/rollout/sandbox, bubblewrap) is opened on a
  copy of it from the shared SandboxPool; the first user message is the issue, the files' names, the test
  command and the tools;
- `bash CMD`: runs CMD in the sandbox (cwd /work/repo, `command_timeout_s` per command); the tool output is
  stdout+stderr clipped to `clip_bytes` bytes (head 2/5 + tail 3/5, the cut marked `[... N bytes cut ...]`),
  then `[exit N]` when the exit code is not 0 (`[timed out]` on a timeout);
- `submit`: the working tree's diff (Sandbox.diff) is taken, the working sandbox closed, a FRESH sandbox opened
  on the original repository, the diff applied there with the test files excluded (edits to tests do not
  count; so do not edits under __pycache__), the setup command (if any) and the task's test command run;
  reward 1 if the tests exit 0, else 0 (also 0 for a patch that does not apply). The episode ends.
- aclose: every sandbox closed, the original's temp folder deleted.

Limits: `max_turns` replies per episode (default 10); the context is the agent loop's (AgentConfig.context_length:
the model's max_context, 1024 tokens for the tiny models; one byte = one token), which a prompt (~130 bytes),
a look at lib.py (<= 250 bytes) and a few clipped outputs fit.

The sandbox pool: one pool per event loop, pool role and (sandboxes, command_timeout_s), shared by every RepoTask
of that loop; its `max_live` is the task option `sandboxes` (a plan's `[embedded] task_options.sandboxes`). A run's
held-out evaluation takes its sandboxes from a pool of its own of the same size (role "eval", rollout/evaluation.py),
so a run holds at most twice `sandboxes` while it evaluates. An episode
holds at most one sandbox at a time (the working one is closed before the fresh one opens), so any
max_live >= 1 cannot deadlock. Per-episode measurements: `RepoTask.metrics()`; pool totals: `pool_stats()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from mixfleet.runner.rollout.tasks.base import StepResult, Task, ToolCall, unknown_tool_message
from mixfleet.runner.rollout.tasks.repo.generator import MAX_DISTRACTORS, MODULE, TEST_FILE, RepoProblem, generate
from mixfleet.runner.rollout.tasks.repo.taskset import RepoSpec, is_test_path, load_task_set

MAX_SANDBOXES = 64
TOOLS_LINE = "Tools: bash CMD, submit."


@functools.lru_cache(maxsize=8)
def _task_set(path: str) -> tuple[RepoSpec, ...]:
    return load_task_set(path)


def task_set_specs(path: str) -> tuple[RepoSpec, ...]:
    """The tasks of a task-set folder, loaded once per process (the folder is read when first configured)."""
    return _task_set(str(Path(path).resolve()))


@dataclass(frozen=True, kw_only=True)
class RepoConfig:
    # options that set resources, never what an episode holds (pretrain's cache key leaves them out)
    RESOURCE_OPTIONS: ClassVar[tuple[str, ...]] = ("sandboxes",)

    max_turns: int = 10                  # replies per episode
    clip_bytes: int = 300                # bytes of a bash output shown to the model (head + tail, cut marked)
    command_timeout_s: float = 10.0      # wall-clock limit of one command (and of the tests on submit)
    sandboxes: int = 2                   # max_live of the shared sandbox pool (sandboxes open at once)
    distractors: int = 1                 # generated repos: correct functions next to the buggy one
    task_set: str = ""                   # a task-set folder (taskset.py); "" = generated repositories

    def __post_init__(self) -> None:
        def need(field: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"repo.{field}: {getattr(self, field)!r} must be {allowed}")
        need("max_turns", isinstance(self.max_turns, int) and 1 <= self.max_turns <= 1000, "an integer in [1, 1000]")
        need("clip_bytes", isinstance(self.clip_bytes, int) and 64 <= self.clip_bytes <= 65536,
             "an integer in [64, 65536]")
        need("command_timeout_s", isinstance(self.command_timeout_s, int | float) and 0 < self.command_timeout_s
             <= 600, "a number in (0, 600]")
        need("sandboxes", isinstance(self.sandboxes, int) and 1 <= self.sandboxes <= MAX_SANDBOXES,
             f"an integer in [1, {MAX_SANDBOXES}]")
        need("distractors", isinstance(self.distractors, int) and 0 <= self.distractors <= MAX_DISTRACTORS,
             f"an integer in [0, {MAX_DISTRACTORS}]")
        need("task_set", isinstance(self.task_set, str), "a folder path string (\"\" = generated repositories)")
        if self.task_set:
            task_set_specs(self.task_set)   # a malformed set is refused when the task is configured


def clip_output(text: str, budget: int) -> str:
    """`text` cut to at most ~`budget` UTF-8 bytes: the first 2/5 and the last 3/5, the cut marked in between."""
    data = text.encode("utf-8")
    if len(data) <= budget:
        return text
    marker_room = 28
    head_n = max(0, (budget - marker_room) * 2 // 5)
    tail_n = max(0, budget - marker_room - head_n)
    cut = len(data) - head_n - tail_n
    head = data[:head_n].decode("utf-8", errors="ignore")
    tail = data[len(data) - tail_n:].decode("utf-8", errors="ignore")
    return f"{head}\n[... {cut} bytes cut ...]\n{tail}"


_POOLS: weakref.WeakKeyDictionary[Any, dict[tuple[str, int, float], Any]] = weakref.WeakKeyDictionary()


def shared_pool(max_live: int, timeout_s: float) -> Any:
    """The SandboxPool of the running event loop for (the episode's pool role, max_live, timeout_s), made on first
    use; the role is the sandbox package's POOL_ROLE ("train", or "eval" inside an evaluation)."""
    from mixfleet.runner.rollout.sandbox import POOL_ROLE, SandboxLimits, SandboxPool

    loop = asyncio.get_running_loop()
    pools = _POOLS.setdefault(loop, {})
    key = (POOL_ROLE.get(), max_live, float(timeout_s))
    if key not in pools:
        pools[key] = SandboxPool(max_live, limits=SandboxLimits(timeout_s=float(timeout_s)))
    return pools[key]


def pool_stats() -> dict[str, Any]:
    """SandboxPool.stats() of every pool of the running loop, keyed 'pool=ROLE,max_live=N,timeout_s=T'."""
    pools = _POOLS.get(asyncio.get_running_loop(), {})
    return {f"pool={k[0]},max_live={k[1]},timeout_s={k[2]:g}": p.stats() for k, p in pools.items()}


def problem_spec(problem: RepoProblem) -> RepoSpec:
    return RepoSpec(name=f"gen-{problem.seed}", files=problem.files, issue=problem.issue,
                    test_command=problem.test_command, test_files=problem.test_files)


class RepoTask(Task):
    """Fix an issue in a repository through a sandboxed bash tool; see the module docstring."""

    name = "repo"
    tools = ("bash", "submit")
    Config = RepoConfig

    def __init__(self, config: RepoConfig | None = None) -> None:
        self.config = config or RepoConfig()
        self.max_turns = self.config.max_turns
        self.spec: RepoSpec | None = None
        self.problem: RepoProblem | None = None     # generated repos: the ground truth (demonstrator only)
        self._src: Path | None = None               # the original repository (never modified)
        self._stack: contextlib.AsyncExitStack | None = None
        self._sandbox: Any = None
        self._submitted = False
        self._reward = 0.0
        self._metrics: dict[str, Any] = {"sandbox_start_s": [], "pool_wait_s": [], "command_s": [],
                                         "commands": 0, "timeouts": 0, "setup_s": 0.0, "submit_s": None,
                                         "patch_files": None}

    # the synchronous core does not apply: every tool does sandbox I/O
    def reset(self, seed: int) -> str:
        raise NotImplementedError("repo: use areset (the repo task's tools are asynchronous)")

    def step(self, call: ToolCall) -> StepResult:
        raise NotImplementedError("repo: use astep (the repo task's tools are asynchronous)")

    @property
    def done(self) -> bool:
        return self._submitted

    def reward(self) -> float:
        return self._reward

    def metrics(self) -> dict[str, Any]:
        """This episode's sandbox measurements: start and pool-wait seconds of each sandbox opened, seconds of
        each command (the model's and the submission's tests), counts, the setup and submission seconds."""
        return {k: list(v) if isinstance(v, list) else v for k, v in self._metrics.items()}

    def _pool(self) -> Any:
        return shared_pool(self.config.sandboxes, self.config.command_timeout_s)

    async def _open(self, stack: contextlib.AsyncExitStack) -> Any:
        t0 = time.perf_counter()
        sandbox = await stack.enter_async_context(self._pool().sandbox(self._src))
        took = time.perf_counter() - t0
        self._metrics["sandbox_start_s"].append(sandbox.start_s)
        self._metrics["pool_wait_s"].append(max(0.0, took - sandbox.start_s))
        return sandbox

    async def _exec(self, sandbox: Any, cmd: str) -> Any:
        result = await sandbox.exec(cmd, timeout_s=self.config.command_timeout_s)
        self._metrics["command_s"].append(result.elapsed_s)
        self._metrics["commands"] += 1
        self._metrics["timeouts"] += int(result.timed_out)
        return result

    def _is_test(self, rel: str) -> bool:
        assert self.spec is not None
        if "__pycache__" in rel.split("/") or rel.endswith(".pyc"):
            return True
        return rel in self.spec.test_files if self.spec.test_files else is_test_path(rel)

    async def areset(self, seed: int) -> str:
        if self.config.task_set:
            specs = task_set_specs(self.config.task_set)
            self.spec = specs[seed % len(specs)]
            prompt = f"{self.spec.issue}\nTests: {self.spec.test_command}. {TOOLS_LINE}"
        else:
            self.problem = generate(seed, distractors=self.config.distractors)
            self.spec = problem_spec(self.problem)
            prompt = f"{self.problem.issue}\nFiles: {MODULE}, {TEST_FILE}. Tests: {self.spec.test_command}. " \
                     f"{TOOLS_LINE}"
        self.problem_name = self.spec.name
        self._src = Path(tempfile.mkdtemp(prefix="mixfleet-repo-"))
        for rel, text in self.spec.files.items():
            path = self._src / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        self._stack = contextlib.AsyncExitStack()
        self._sandbox = await self._open(self._stack)
        if self.spec.setup_command:
            t0 = time.perf_counter()
            res = await self._exec(self._sandbox, self.spec.setup_command)
            self._metrics["setup_s"] += time.perf_counter() - t0
            if res.exit_code != 0:
                raise RuntimeError(f"repo task {self.spec.name!r}: setup_command exited {res.exit_code}: "
                                   f"{clip_output(res.output, 200)}")
        return prompt

    async def astep(self, call: ToolCall) -> StepResult:
        if self.spec is None or self._submitted:
            raise RuntimeError("repo: astep() before areset() or after submit")
        if call.name == "bash":
            if not call.args:
                return StepResult(output="error: bash takes a command: bash CMD")
            res = await self._exec(self._sandbox, call.args)
            out = clip_output(res.output, self.config.clip_bytes)
            if res.timed_out:
                out += f"\n[timed out after {self.config.command_timeout_s:g}s]"
            elif res.exit_code != 0:
                out += f"\n[exit {res.exit_code}]"
            return StepResult(output=out)
        if call.name == "submit":
            return StepResult(output=await self._submit(), done=True)
        return StepResult(output=unknown_tool_message(call, self.tools))

    async def _submit(self) -> str:
        from mixfleet.runner.rollout.sandbox import apply_patch

        assert self.spec is not None and self._stack is not None
        t0 = time.perf_counter()
        patch = await self._sandbox.diff()
        await self._stack.aclose()            # the working sandbox goes before the fresh one is requested
        self._sandbox = None
        self._submitted = True
        async with contextlib.AsyncExitStack() as stack:
            fresh = await self._open(stack)
            try:
                self._metrics["patch_files"] = apply_patch(fresh.workdir, patch, exclude=self._is_test)
            except ValueError as e:
                self._metrics["submit_s"] = time.perf_counter() - t0
                return clip_output(f"submitted: the patch does not apply ({e}); reward 0", self.config.clip_bytes)
            if self.spec.setup_command:
                await self._exec(fresh, self.spec.setup_command)
            res = await self._exec(fresh, self.spec.test_command)
        self._reward = 1.0 if res.exit_code == 0 and not res.timed_out else 0.0
        self._metrics["submit_s"] = time.perf_counter() - t0
        return "submitted: tests pass" if self._reward else "submitted: tests fail"

    async def aclose(self) -> None:
        try:
            if self._stack is not None:
                await self._stack.aclose()
        finally:
            self._stack, self._sandbox = None, None
            if self._src is not None:
                shutil.rmtree(self._src, ignore_errors=True)
                self._src = None
