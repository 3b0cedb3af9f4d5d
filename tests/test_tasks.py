"""Tasks: the guess and calc problems, their tools and rewards, the registry and the seed splits.

Covers: problems are pure functions of the seed; tool answers (higher/lower/correct, calculator
values, errors for bad calls); rewards; binary search solves every guess problem within the cap;
the calculator refuses anything but integer + - * ( ); registry and config errors name the field.
"""

from __future__ import annotations

import asyncio
import math

import pytest
from mixfleet.runner.rollout.tasks import (
    EVAL_SEED_START,
    TASKS,
    Task,
    ToolCall,
    make_task,
    register_task,
    split_of,
    split_seeds,
    task_names,
)
from mixfleet.runner.rollout.tasks.calc import CalcConfig, evaluate, make_expression
from mixfleet.runner.rollout.tasks.guess import GuessConfig, GuessTask


def guess(task: Task, k: int | str) -> tuple[str, bool]:
    r = task.step(ToolCall(name="guess", args=str(k)))
    return r.output, r.done


def test_guess_problem_is_a_function_of_the_seed() -> None:
    a, b = make_task("guess"), make_task("guess")
    assert a.reset(7) == b.reset(7)
    assert a.target == b.target
    targets = set()
    for seed in range(300):
        t = make_task("guess", n_max=10)
        t.reset(seed)
        assert 1 <= t.target <= 10
        targets.add(t.target)
    assert targets == set(range(1, 11))


def test_guess_answers_and_reward() -> None:
    t = make_task("guess", n_max=100)
    prompt = t.reset(3)
    assert prompt == "Find the hidden number in 1..100. Tool: guess K."
    target = t.target
    assert guess(t, target - 1 if target > 1 else target + 1)[0] == ("higher" if target > 1 else "lower")
    assert t.reward() == 0.0 and not t.done
    assert guess(t, "abc") == ("error: guess takes one integer in 1..100", False)
    assert guess(t, 0)[0].startswith("error:") and guess(t, 101)[0].startswith("error:")
    out = t.step(ToolCall(name="answer", args="5")).output
    assert out == "error: unknown tool 'answer'; tools: guess"
    assert guess(t, target) == ("correct", True)
    assert t.done and t.reward() == 1.0


@pytest.mark.parametrize("n_max", [2, 7, 100, 1000])
def test_binary_search_solves_every_problem_within_log2(n_max: int) -> None:
    cap = math.ceil(math.log2(n_max + 1))
    for seed in range(200):
        t = make_task("guess", n_max=n_max)
        t.reset(seed)
        lo, hi = 1, n_max
        for _ in range(cap):
            k = (lo + hi) // 2
            out, done = guess(t, k)
            if done:
                break
            lo, hi = (k + 1, hi) if out == "higher" else (lo, k - 1)
        assert t.reward() == 1.0, (seed, t.target)


def test_calc_expressions_and_tools() -> None:
    cfg = CalcConfig()
    import random

    rng = random.Random(0)
    for _ in range(200):
        e = make_expression(rng, cfg)
        assert set(e) <= set("0123456789+-*")
        assert evaluate(e) == eval(e)  # noqa: S307 - the reference for our safe evaluator
    t = make_task("calc")
    prompt = t.reset(11)
    assert prompt == f"Compute {t.expression}. Tools: calc EXPR, answer N."
    assert t.step(ToolCall(name="calc", args=t.expression)).output == str(t.value)
    assert t.step(ToolCall(name="calc", args="(2+3)*-4")).output == "-20"
    assert not t.done and t.reward() == 0.0
    assert t.step(ToolCall(name="answer", args="x")).output == "error: answer takes one integer"
    r = t.step(ToolCall(name="answer", args=str(t.value)))
    assert (r.output, r.done, t.reward()) == ("submitted", True, 1.0)
    t2 = make_task("calc")
    t2.reset(11)
    t2.step(ToolCall(name="answer", args=str(t2.value + 1)))
    assert t2.done and t2.reward() == 0.0


@pytest.mark.parametrize("expr", ["2**10", "7/2", "__import__('os')", "a+1", "1.5+1", "9" * 70, "", "1+"])
def test_calculator_refuses_anything_else(expr: str) -> None:
    with pytest.raises(ValueError):
        evaluate(expr)
    t = make_task("calc")
    t.reset(0)
    assert t.step(ToolCall(name="calc", args=expr)).output.startswith("error: ")


def test_registry_and_config_errors() -> None:
    assert task_names() == ("calc", "guess", "repo")
    with pytest.raises(ValueError, match="task: 'chess' is not one of calc, guess"):
        make_task("chess")
    with pytest.raises(ValueError, match="unknown option 'n'; known: max_turns, n_max"):
        make_task("guess", n=3)
    with pytest.raises(ValueError, match="guess.n_max: 1 must be an integer in"):
        GuessConfig(n_max=1)
    with pytest.raises(ValueError, match="calc.max_operands"):
        CalcConfig(min_operands=3, max_operands=2)
    assert make_task("guess", max_turns=5).max_turns == 5

    class Other(GuessTask):
        name = "guess"

    with pytest.raises(ValueError, match="already registered"):
        register_task(Other)
    assert TASKS["guess"] is GuessTask
    with pytest.raises(TypeError):
        Task()  # type: ignore[abstract]


def test_async_defaults_call_the_sync_methods() -> None:
    async def go() -> tuple[str, str, float]:
        t = make_task("guess")
        p = await t.areset(5)
        r = await t.astep(ToolCall(name="guess", args=str(t.target)))
        await t.aclose()
        return p, r.output, t.reward()

    p, out, reward = asyncio.run(go())
    assert p.startswith("Find the hidden number") and out == "correct" and reward == 1.0


def test_splits_are_disjoint_seed_ranges() -> None:
    train, ev = split_seeds("train", 5), split_seeds("eval", 5, offset=2)
    assert train == [0, 1, 2, 3, 4]
    assert ev == [EVAL_SEED_START + 2 + i for i in range(5)]
    assert {split_of(s) for s in train} == {"train"} and {split_of(s) for s in ev} == {"eval"}
    with pytest.raises(ValueError, match="split: 'test' is not one of train, eval"):
        split_seeds("test", 1)
    with pytest.raises(ValueError, match="exceeds the eval split"):
        split_seeds("eval", 2, offset=EVAL_SEED_START)
    with pytest.raises(ValueError):
        split_of(-1)
