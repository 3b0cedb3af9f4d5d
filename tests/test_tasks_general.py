"""The generalisation split (issue 41): problems a task never shows in training, the eval split's unchanged.

guess: the general split's range is 1..2N and its target in N+1..2N, so no general target (and no general prompt)
occurs among training's; calc: every general operand lies above the training range, so no general expression
occurs among training's. Both are checked against the problems of many training seeds, and the eval split's
problems against the draw they always had (existing results were measured on them).
"""

from __future__ import annotations

import asyncio
import random

import pytest
from mixfleet.runner.rollout.evaluation import EvalConfig
from mixfleet.runner.rollout.tasks import ToolCall, make_task, split_of, split_seeds
from mixfleet.runner.rollout.tasks.base import GENERAL_SEED_START, is_general
from mixfleet.runner.rollout.tasks.calc import CalcConfig, make_expression

TRAIN = split_seeds("train", 20_000)
GENERAL = split_seeds("general", 2_000)


def test_general_is_its_own_seed_range() -> None:
    assert GENERAL[0] == GENERAL_SEED_START and {split_of(s) for s in GENERAL} == {"general"}
    assert all(is_general(s) for s in GENERAL) and not any(is_general(s) for s in TRAIN[:100])
    assert not any(is_general(s) for s in split_seeds("eval", 100))
    with pytest.raises(ValueError, match="allowed: eval, general"):
        EvalConfig(split="train")
    assert EvalConfig(split="general").split == "general" and EvalConfig().split == "eval"


def _guess(seed: int) -> tuple[str, int]:
    t = make_task("guess")
    prompt = t.reset(seed)
    return prompt, t.target


def test_no_general_guess_problem_occurs_in_training() -> None:
    train = {_guess(s) for s in TRAIN}
    general = {_guess(s) for s in GENERAL}
    assert {p for p, _ in train} == {"Find the hidden number in 1..50. Tool: guess K."}
    assert not {t for _, t in general} & {t for _, t in train}           # no general target is a training one
    assert not {p for p, _ in general} & {p for p, _ in train}
    assert {t for _, t in general} == set(range(51, 101))                 # the whole held-out range is drawn


def test_general_guess_is_solvable_in_its_range() -> None:
    t = make_task("guess")
    t.reset(GENERAL[0])
    lo, hi = 1, 100
    for _ in range(7):                      # binary search over 1..100: at most 7 guesses
        k = (lo + hi) // 2
        out = asyncio.run(t.astep(ToolCall(name="guess", args=str(k)))).output
        if out == "correct":
            break
        lo, hi = (k + 1, hi) if out == "higher" else (lo, k - 1)
    assert t.reward() == 1.0
    assert t.step(ToolCall(name="guess", args="101")).output == "error: guess takes one integer in 1..100"


def _calc(seed: int) -> str:
    t = make_task("calc")
    t.reset(seed)
    return t.expression


def test_no_general_calc_expression_occurs_in_training() -> None:
    train = {_calc(s) for s in TRAIN}
    general = {_calc(s) for s in GENERAL}
    assert len(general) > 1_500 and not general & train
    cfg = CalcConfig()
    for e in general:
        ops = [int(x) for x in e.replace("*", "+").replace("-", "+").split("+")]
        assert all(cfg.max_operand < x <= 2 * cfg.max_operand for x in ops), e


def test_the_eval_split_problems_are_unchanged() -> None:
    cfg = CalcConfig()
    for s in split_seeds("eval", 64):
        assert _guess(s)[1] == random.Random(s).randint(1, 50)
        assert _calc(s) == make_expression(random.Random(s), cfg)
        rng = random.Random(s)                                   # the draw as it was written before the split
        n = rng.randint(cfg.min_operands, cfg.max_operands)
        parts = [str(rng.randint(1, cfg.max_operand))]
        for _ in range(n - 1):
            parts += [rng.choice(("+", "-", "*")), str(rng.randint(1, cfg.max_operand))]
        assert _calc(s) == "".join(parts)


def test_a_paired_difference_reads_an_older_evaluation_as_the_eval_splits() -> None:
    from mixfleet.runner.orchestration.evaluate_run import paired_difference

    old = {"settings": {"problems": 2, "k": 1, "seed": 0}, "problem_rewards": [1.0, 0.0]}   # before "split"
    new = {"settings": {"problems": 2, "k": 1, "seed": 0, "split": "eval"}, "problem_rewards": [0.0, 0.0]}
    assert paired_difference(old, new)["difference"] == 0.5
    general = {**new, "settings": {**new["settings"], "split": "general"}}
    with pytest.raises(ValueError, match="split"):
        paired_difference(old, general)
