"""The held-out evaluation's nucleus (issue 23): `top_p` < 1 evaluates the policy a top-p run trains.

A top-p run's loss replays the sampler's kept set, so the tokens outside it get no gradient: the policy it trains is
the nucleus one, and an evaluation over the full vocabulary (the seed's, top_p = 1, still the default) measures a
different policy (docs/learning.md). The setting goes plan embedded.eval_top_p (a run's override:
`--set embedded.eval_top_p=0.95`) -> EvalConfig -> the engine's SamplingParams, and the run log's evaluation event
records it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.plan.planspec import EmbeddedPlan
from mixfleet.runner.orchestration.config import run_settings
from mixfleet.runner.orchestration.onpolicy import OnPolicyConfig
from mixfleet.runner.orchestration.recipe import apply_overrides
from mixfleet.runner.rollout.evaluation import EvalConfig, pass_at_k_eval


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, True, "0.9"])
def test_a_bad_eval_top_p_is_refused_with_its_field(bad: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"EvalConfig.top_p = .*allowed: a number in \(0, 1\]"):
        EvalConfig(top_p=bad)
    with pytest.raises(ValueError, match=r"OnPolicyConfig.eval_top_p = .*allowed: a number in \(0, 1\]"):
        OnPolicyConfig(eval_top_p=bad)
    with pytest.raises(SpecError, match="eval_top_p"):
        EmbeddedPlan(eval_top_p=bad)


def test_the_plan_owns_eval_top_p_and_a_run_may_override_it(tmp_path: Path) -> None:
    from mixfleet.policies.plan import load_plan

    plan = load_plan("learning-onpolicy")
    assert EmbeddedPlan().eval_top_p == 1.0                          # the seed's: the full vocabulary
    assert run_settings(plan).eval_top_p == plan.embedded.eval_top_p
    assert run_settings(apply_overrides(plan, {"embedded.eval_top_p": 0.95})).eval_top_p == 0.95


@pytest.mark.slow
def test_a_narrow_nucleus_reaches_the_engine(tmp_path: Path) -> None:
    """At top_p 1e-6 the nucleus is the top token: the evaluation is greedy, so two sampling seeds score the same;
    at top_p 1 (T = 1) they do not. Fails if the setting stops short of the engine's sampler."""
    from mixfleet.runner.orchestration.pretrain import pretrain

    base = pretrain().path                          # the cached base policy (tests/test_learning.py's)

    def reward(top_p: float, seed: int) -> float:
        cfg = EvalConfig(problems=16, k=2, max_turns=8, max_new_tokens=24, top_p=top_p, seed=seed)
        return asyncio.run(pass_at_k_eval(base, cfg)).reward_mean

    narrow = [reward(1e-6, s) for s in (0, 1)]
    full = [reward(1.0, s) for s in (0, 1)]
    assert narrow[0] == narrow[1]
    assert full[0] != full[1]
