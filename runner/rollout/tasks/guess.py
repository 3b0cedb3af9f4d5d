"""The `guess` task: find a hidden number in [1, N] with a `guess` tool that answers higher/lower.

The simplest verifiable multi-turn tool-use problem: a policy that binary-searches solves every
problem within ceil(log2(N + 1)) guesses, a policy that guesses at random rarely does within the
turn cap. Reward 1 if the number is found within the cap, else 0.

Tool: `guess K` -> "higher" (the hidden number is higher than K), "lower", or "correct" (done).
A guess that is not an integer in [1, N] gets an error output and uses a turn like any guess.

The "general" split (base.py `is_general`) holds out a range: its problems are 1..2N with the hidden number in
N+1..2N, a prompt and targets training never shows (binary search needs at most one guess more).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from mixfleet.runner.rollout.tasks.base import StepResult, Task, ToolCall, is_general, unknown_tool_message

MAX_N = 1_000_000


@dataclass(frozen=True, kw_only=True)
class GuessConfig:
    n_max: int = 50                      # the hidden number is uniform in [1, n_max]
    max_turns: int = 7                   # replies per episode (guesses + replies without a call)

    def __post_init__(self) -> None:
        if not isinstance(self.n_max, int) or not 2 <= self.n_max <= MAX_N:
            raise ValueError(f"guess.n_max: {self.n_max!r} must be an integer in [2, {MAX_N}]")
        if not isinstance(self.max_turns, int) or not 1 <= self.max_turns <= 1000:
            raise ValueError(f"guess.max_turns: {self.max_turns!r} must be an integer in [1, 1000]")


class GuessTask(Task):
    """Find the hidden number; see the module docstring."""

    name = "guess"
    tools = ("guess",)
    Config = GuessConfig

    def __init__(self, config: GuessConfig | None = None) -> None:
        self.config = config or GuessConfig()
        self.max_turns = self.config.max_turns
        self.target: int | None = None
        self.n = self.config.n_max            # this episode's range 1..n (2 * n_max on the general split)
        self.found = False
        self.guesses: list[int] = []

    def reset(self, seed: int) -> str:
        n = self.config.n_max
        if is_general(seed):        # a held-out range and targets (module docstring)
            self.n, self.target = 2 * n, random.Random(seed).randint(n + 1, 2 * n)
        else:                       # train / eval: unchanged (existing results depend on these problems)
            self.n, self.target = n, random.Random(seed).randint(1, n)
        self.found = False
        self.guesses = []
        return f"Find the hidden number in 1..{self.n}. Tool: guess K."

    def step(self, call: ToolCall) -> StepResult:
        if self.target is None:
            raise RuntimeError("guess: step() before reset()")
        if call.name != "guess":
            return StepResult(output=unknown_tool_message(call, self.tools))
        try:
            k = int(call.args.strip())
        except ValueError:
            k = 0
        if not 1 <= k <= self.n:
            return StepResult(output=f"error: guess takes one integer in 1..{self.n}")
        self.guesses.append(k)
        if k == self.target:
            self.found = True
            return StepResult(output="correct", done=True)
        return StepResult(output="higher" if self.target > k else "lower")

    @property
    def done(self) -> bool:
        return self.found

    def reward(self) -> float:
        return 1.0 if self.found else 0.0
