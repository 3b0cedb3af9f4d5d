"""The `calc` task: evaluate a small integer expression with a `calc` tool, then `answer` it.

Two tools, two turns for a good policy: `calc EXPR` returns the value (computed safely: integers,
+ - *, parentheses), `answer N` submits and ends the episode. Reward 1 if the submitted answer
equals the expression's value. A policy that answers without the calculator is right only when its
own arithmetic is, which a tiny byte-level model's seldom is: that is the gap RL can close.

The "general" split (base.py `is_general`) draws every operand from (max_operand, 2 * max_operand]: expressions
training never shows.
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass

from mixfleet.runner.rollout.tasks.base import StepResult, Task, ToolCall, is_general, unknown_tool_message

MAX_EXPR_CHARS = 64
MAX_ABS_VALUE = 10**12
_OPS = ("+", "-", "*")


@dataclass(frozen=True, kw_only=True)
class CalcConfig:
    min_operands: int = 2                # operands per expression, drawn uniformly in [min, max]
    max_operands: int = 3
    max_operand: int = 20                # operands are integers in [1, max_operand]
    max_turns: int = 4                   # replies per episode

    def __post_init__(self) -> None:
        if not isinstance(self.min_operands, int) or not 2 <= self.min_operands <= 6:
            raise ValueError(f"calc.min_operands: {self.min_operands!r} must be an integer in [2, 6]")
        if not isinstance(self.max_operands, int) or not self.min_operands <= self.max_operands <= 6:
            raise ValueError(f"calc.max_operands: {self.max_operands!r} must be an integer in [min_operands, 6]")
        if not isinstance(self.max_operand, int) or not 2 <= self.max_operand <= 1000:
            raise ValueError(f"calc.max_operand: {self.max_operand!r} must be an integer in [2, 1000]")
        if not isinstance(self.max_turns, int) or not 1 <= self.max_turns <= 1000:
            raise ValueError(f"calc.max_turns: {self.max_turns!r} must be an integer in [1, 1000]")


def make_expression(rng: random.Random, config: CalcConfig, *, general: bool = False) -> str:
    """A random expression like `12*7+3` (no spaces; left-to-right text, usual precedence); `general`: operands
    in (max_operand, 2 * max_operand] instead of [1, max_operand]."""
    lo, hi = (config.max_operand + 1, 2 * config.max_operand) if general else (1, config.max_operand)
    n = rng.randint(config.min_operands, config.max_operands)
    parts = [str(rng.randint(lo, hi))]
    for _ in range(n - 1):
        parts.append(rng.choice(_OPS))
        parts.append(str(rng.randint(lo, hi)))
    return "".join(parts)


def evaluate(expr: str) -> int:
    """Value of an integer expression with + - * and parentheses; ValueError on anything else."""
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an expression") from None

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
            a, b = ev(node.left), ev(node.right)
            v = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
            if abs(v) > MAX_ABS_VALUE:
                raise ValueError("value too large")
            return v
        raise ValueError("only integers, + - * and parentheses")

    return ev(tree.body)


class CalcTask(Task):
    """Evaluate an expression with the calculator, then answer; see the module docstring."""

    name = "calc"
    tools = ("calc", "answer")
    Config = CalcConfig

    def __init__(self, config: CalcConfig | None = None) -> None:
        self.config = config or CalcConfig()
        self.max_turns = self.config.max_turns
        self.expression: str | None = None
        self.value: int | None = None
        self.answered: int | None = None
        self.submitted = False

    def reset(self, seed: int) -> str:
        self.expression = make_expression(random.Random(seed), self.config, general=is_general(seed))
        self.value = evaluate(self.expression)
        self.answered = None
        self.submitted = False
        return f"Compute {self.expression}. Tools: calc EXPR, answer N."

    def step(self, call: ToolCall) -> StepResult:
        if self.expression is None:
            raise RuntimeError("calc: step() before reset()")
        if call.name == "calc":
            try:
                return StepResult(output=str(evaluate(call.args)))
            except ValueError as e:
                return StepResult(output=f"error: {e}")
        if call.name == "answer":
            try:
                self.answered = int(call.args.strip())
            except ValueError:
                return StepResult(output="error: answer takes one integer")
            self.submitted = True
            return StepResult(output="submitted", done=True)
        return StepResult(output=unknown_tool_message(call, self.tools))

    @property
    def done(self) -> bool:
        return self.submitted

    def reward(self) -> float:
        return 1.0 if self.submitted and self.answered == self.value else 0.0
