"""Held-out evaluation like the seed's: pass@k on the task's evaluation split, BF16 weights, full vocabulary.

Every N updates the orchestrator evaluates the weights it just exported: `problems` held-out problems
(seeds of the task's "eval" split, the same ones every time, so the curve compares like with like), `k`
samples each, sampled at the run's temperature from the FULL vocabulary by default (top_p = 1, no top-k;
`top_p` < 1 evaluates the nucleus policy a top-p run trains, see docs/learning.md) by an embedded engine
loading the checkpoint in BF16, independent of the fleet's mixed precisions. A problem
passes when any of its k episodes earns reward >= `success_reward`; pass@k is the share that pass.
The engine runs in the caller's process on its own thread, so the asyncio loop (and the run) keep going.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.runner.rollout.agent import AgentConfig, engine_generate, run_episode
from mixfleet.runner.rollout.sandbox.pool import pool_role
from mixfleet.runner.rollout.tasks import make_task, split_seeds
from mixfleet.runner.sampler.engine_api import TOP_P_ALLOWED, SamplingParams, valid_top_p


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    task: str = "guess"
    task_options: dict[str, Any] = field(default_factory=dict)
    problems: int = 8                      # held-out problems (seeds of the eval split, from its start)
    split: str = "eval"                    # "general": the problems unlike training's (runner/rollout/tasks/base.py)
    k: int = 4                             # samples per problem
    max_turns: int | None = None
    max_new_tokens: int = 48
    temperature: float = 1.0
    top_p: float = 1.0                     # 1: the full vocabulary (the seed's); < 1: the nucleus a top-p run trains
    success_reward: float = 1.0            # an episode with reward >= this solves its problem
    precision: str = "bf16"                # the evaluation engine's weight format
    seed: int = 0
    threads: int = 1                       # torch threads of the evaluation engine

    def __post_init__(self) -> None:
        for name in ("problems", "k", "max_new_tokens", "threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"EvalConfig.{name} = {v!r}; allowed: an integer >= 1")
        if not self.temperature > 0:
            raise ValueError(f"EvalConfig.temperature = {self.temperature!r}; allowed: > 0")
        if self.split not in ("eval", "general"):
            raise ValueError(f"EvalConfig.split = {self.split!r}; allowed: eval, general")
        if not valid_top_p(self.top_p):
            raise ValueError(f"EvalConfig.top_p = {self.top_p!r}; allowed: {TOP_P_ALLOWED}")


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    pass_at_k: float
    reward_mean: float
    problems: int
    k: int
    solved: int
    wall_s: float
    rewards: tuple[float, ...] = ()        # every episode's reward, problem by problem (k each, in sample order)
    problem_names: tuple[str, ...] = ()    # each problem's name (`Task.problem_name`, a task set's task folder;
                                           # "seed N" for a task that does not name its problems)


def pass_at_k(successes: list[list[bool]]) -> float:
    """Share of problems with at least one success among their samples."""
    if not successes:
        return float("nan")
    return sum(1.0 for s in successes if any(s)) / len(successes)


async def pass_at_k_eval(checkpoint: str | Path, config: EvalConfig | None = None) -> EvalResult:
    """Evaluate the checkpoint (see the module doc); awaits without blocking the caller's event loop."""
    from mixfleet.runner.sampler.engine import Engine

    config = config or EvalConfig()
    t0 = time.perf_counter()
    engine = await asyncio.to_thread(Engine, str(checkpoint), precision=config.precision, seed=config.seed,
                                     max_running_requests=config.problems * config.k)
    stop = threading.Event()
    thread = threading.Thread(target=engine.run_forever, args=(stop,), name="mixfleet-eval-engine", daemon=True)
    thread.start()
    generate = engine_generate(engine)
    seeds = split_seeds(config.split, config.problems)
    agent = AgentConfig(context_length=engine.context_length, max_turns=config.max_turns,
                        sampling=SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                                                top_p=config.top_p))
    tasks = [make_task(config.task, **config.task_options) for _ in range(len(seeds) * config.k)]
    try:
        with pool_role("eval"):     # sandboxed tasks: the evaluation's own pool, never the training episodes'
            eps = await asyncio.gather(*[
                run_episode(tasks[i * config.k + j], s, generate, session_id=f"eval-{s}-{j}",
                            config=dataclasses.replace(agent, sampling=dataclasses.replace(
                                agent.sampling, sampling_seed=config.seed * 1_000_003 + i * 97 + j)))
                for i, s in enumerate(seeds) for j in range(config.k)])
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 10)
    succ = [[eps[i * config.k + j].reward >= config.success_reward for j in range(config.k)]
            for i in range(config.problems)]
    rewards = [e.reward for e in eps]
    return EvalResult(pass_at_k=pass_at_k(succ), reward_mean=sum(rewards) / len(rewards), problems=config.problems,
                      k=config.k, solved=sum(1 for s in succ if any(s)), wall_s=time.perf_counter() - t0,
                      rewards=tuple(float(r) for r in rewards),
                      problem_names=tuple(tasks[i * config.k].problem_name or f"seed {s}" for i, s in enumerate(seeds)))
