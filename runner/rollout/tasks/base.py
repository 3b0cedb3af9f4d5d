"""The task interface: what an RL environment must provide to the agent loop (runner/rollout/agent.py).

A task is a small, verifiable, multi-turn tool-use problem. The agent loop owns the tokens and the
chat format; a task only deals in text: it writes the first user message (`reset`), answers each
parsed tool call with an output text (`step`), says when it is finished and what the reward is.
That split is what lets a real repository task plug into the same loop as the toy ones.

Lifecycle of one episode (one fresh Task instance per episode, made by the registry):

    task = make_task("guess")          # runner/rollout/tasks/__init__.py
    prompt = await task.areset(seed)   # the problem is a pure function of (task config, seed)
    while not finished:
        result = await task.astep(ToolCall(name="guess", args="50"))   # -> StepResult
    reward = task.reward()             # 0.0 .. 1.0, valid at any time (0 until solved)
    await task.aclose()

`reset` / `step` / `close` are plain methods for tasks that compute in-process; the agent calls the
`a*` coroutines, whose defaults call the plain ones, so a task whose tools do I/O (a sandbox, an
HTTP service) overrides the coroutines instead and never blocks the event loop.

A real repository task fits the same interface (sketch, not shipped):

    class RepoTask(Task):
        '''Fix an issue in a repository; reward 1 if the submitted patch passes the tests.'''
        name = "repo"
        tools = ("bash", "submit")

        async def areset(self, seed):             # seed -> one (repo, commit, issue, tests) record
            self.record = dataset[seed % len(dataset)]
            self.sandbox = await sandboxes.create(image=self.record.image)
            return self.record.issue_text + "\\nTools: bash CMD, submit."

        async def astep(self, call):
            if call.name == "bash":               # run a command, return its (clipped) output
                out = await self.sandbox.exec(call.args, timeout_s=60)
                return StepResult(output=out.clip(4000), done=False)
            if call.name == "submit":             # diff the work tree, test it in a FRESH sandbox
                patch = await self.sandbox.exec("git diff")
                fresh = await sandboxes.create(image=self.record.image)
                ok = await fresh.apply_and_test(patch, self.record.tests)
                self._reward = 1.0 if ok else 0.0
                return StepResult(output="submitted", done=True)
            return StepResult(output=unknown_tool_message(call, self.tools), done=False)

        def reward(self):
            return self._reward

        async def aclose(self):
            await self.sandbox.terminate()

Seeds and splits: every problem is a pure function of its seed. Seeds in [0, EVAL_SEED_START) are
for training; seeds from EVAL_SEED_START on are the held-out evaluation split (`split_seeds`). For
tasks with a small problem space (guess's N targets) held-out seeds can still draw problems seen in
training: held out means unseen seeds, not necessarily unseen problems. The "general" split (seeds from
GENERAL_SEED_START on, `is_general`) tests generalisation: a task draws its problems there from outside its
training distribution (guess: a range 1..2N with the target in N+1..2N; calc: every operand above the training
range), so that no general problem occurs in training (issue 41). The eval split's problems are unchanged.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar

SPLITS: tuple[str, ...] = ("train", "eval", "general")
EVAL_SEED_START = 1_000_000_000          # first seed of the held-out evaluation split
EVAL_SEED_COUNT = 1_000_000              # size of the evaluation seed range
GENERAL_SEED_START = 2_000_000_000       # first seed of the generalisation split (problems unlike training's)
GENERAL_SEED_COUNT = 1_000_000
_SPLIT_RANGES = {"train": (0, EVAL_SEED_START), "eval": (EVAL_SEED_START, EVAL_SEED_COUNT),
                 "general": (GENERAL_SEED_START, GENERAL_SEED_COUNT)}      # split -> (first seed, seeds)


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    """One tool call parsed from a reply: `<|call|>NAME ARGS<|endcall|>`."""

    name: str                            # first whitespace-separated word ("" when the call is empty)
    args: str = ""                       # the rest, stripped


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """A task's answer to one tool call."""

    output: str                          # text shown to the model after <|tool|> (plain text, no specials)
    done: bool = False                   # True when the task is finished (solved or submitted)


class Task(abc.ABC):
    """Base class of every task; subclasses set `name`, `tools` and implement reset / step / reward.

    `max_turns` is the task's turn cap (assistant replies per episode) that the agent loop applies
    unless its own config overrides it.
    """

    name: ClassVar[str] = ""
    tools: ClassVar[tuple[str, ...]] = ()
    Config: ClassVar[type]               # the task's frozen kw-only config dataclass (make_task's options)
    max_turns: int = 8
    problem_name: str = ""               # the problem the last reset drew, for a task that names its problems (a
                                         # task set's task folder); "": the evaluation names it by its seed

    # ---- synchronous core (in-process tasks implement these) ----------------------------------
    @abc.abstractmethod
    def reset(self, seed: int) -> str:
        """Set up the problem for `seed`; return the first user message (plain text)."""

    @abc.abstractmethod
    def step(self, call: ToolCall) -> StepResult:
        """Run one tool call; unknown tools and bad arguments get an error output, not an exception."""

    @abc.abstractmethod
    def reward(self) -> float:
        """Reward of the episode so far (0.0 .. 1.0); the agent reads it when the episode ends."""

    @property
    @abc.abstractmethod
    def done(self) -> bool:
        """True once the task is finished (the finish check)."""

    def close(self) -> None:
        """Release what reset acquired (nothing for in-process tasks)."""
        return None

    # ---- what the agent loop calls (override for tasks whose tools do I/O) --------------------
    async def areset(self, seed: int) -> str:
        return self.reset(seed)

    async def astep(self, call: ToolCall) -> StepResult:
        return self.step(call)

    async def aclose(self) -> None:
        self.close()

    def metrics(self) -> dict[str, Any]:
        """The episode's measurements of its environment (the repo task: each sandbox's start and pool wait, each
        command's seconds; runner/rollout/tasks/repo/task.py); {} for an in-process task."""
        return {}


def unknown_tool_message(call: ToolCall, tools: tuple[str, ...]) -> str:
    """The output a task gives for a call to a tool it does not have."""
    return f"error: unknown tool '{call.name}'; tools: {', '.join(tools)}"


def split_seeds(split: str, n: int, *, offset: int = 0) -> list[int]:
    """`n` consecutive seeds of a split, starting `offset` seeds into it (ValueError names the allowed)."""
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not one of {', '.join(SPLITS)}")
    if n < 0 or offset < 0:
        raise ValueError(f"n, offset: ({n}, {offset}) must be >= 0")
    start, size = _SPLIT_RANGES[split]
    if offset + n > size:
        raise ValueError(f"offset + n: {offset + n} exceeds the {split} split's {size} seeds")
    return list(range(start + offset, start + offset + n))


def split_of(seed: int) -> str:
    """Which split a seed belongs to."""
    for split, (start, size) in _SPLIT_RANGES.items():
        if start <= seed < start + size:
            return split
    raise ValueError(f"seed: {seed} is outside the splits [0, {EVAL_SEED_START + EVAL_SEED_COUNT}) and "
                     f"[{GENERAL_SEED_START}, {GENERAL_SEED_START + GENERAL_SEED_COUNT})")


def is_general(seed: int) -> bool:
    """Whether a seed is of the generalisation split (its problem is drawn from outside training's)."""
    return GENERAL_SEED_START <= seed < GENERAL_SEED_START + GENERAL_SEED_COUNT
