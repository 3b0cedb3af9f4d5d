"""One owner per run setting (issue 25 item 2): the plan's [embedded] table owns the settings a plan carries,
`RunConfig`'s fields of the same names are this run's overrides (None: the plan's; 0 and false are values),
merged once by `RunConfig.resolved(plan)`; no free-form `[embedded.extra]` (a legacy one is lifted into the
table at load, each key checked).

Before: `config.x or emb.x` (a 0 taken for "unset"), the recipe in a free-form `extra` dict checked against a
hand-written `settable` set, and `RunConfig.task = "guess"` by default, so a run built without the CLI never
took the plan's own task.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.paths import data_path
from mixfleet.policies.plan import EmbeddedPlan, load_plan, plan_from_dict
from mixfleet.runner.orchestration.config import PLAN_SETTINGS, RunConfig

BASE = {"out_dir": "/nonexistent", "init_checkpoint": "/nonexistent"}


def test_none_is_the_plans_and_zero_or_false_is_the_runs() -> None:
    plan = load_plan("tiny-cpu")
    cfg = RunConfig(**BASE).resolved(plan)
    assert (cfg.lr, cfg.lr_warmup_steps, cfg.loss_agg, cfg.advantage_std, cfg.eval_problems, cfg.eval_every,
            cfg.max_new_tokens, cfg.task) == (1.5e-4, 3, "seq_mean_token_mean", True, 32, 10, 24, "guess")
    own = RunConfig(**BASE, eval_every=0, lr_warmup_steps=0, top_k_record=0, advantage_std=False,
                    eval_at_start=False, trainer_threads=2).resolved(plan)
    assert (own.eval_every, own.lr_warmup_steps, own.top_k_record, own.advantage_std, own.eval_at_start,
            own.trainer_threads) == (0, 0, 0, False, False, 2)
    assert own.resolved(plan) is own                                     # resolved once: nothing left to take
    assert all(getattr(cfg, name) is not None for name in PLAN_SETTINGS)


def test_the_overridable_settings_are_the_plans_own() -> None:
    # derived, not a hand-written list: every [embedded] setting but the fleet's scale-down and the base policy's
    # pretraining (a run is given its base: --init) is a run setting
    assert set(PLAN_SETTINGS) == ({f.name for f in dataclasses.fields(EmbeddedPlan)}
                                  - {"max_replicas_per_group", "base_steps"})


def test_a_legacy_extra_table_is_lifted_into_embedded() -> None:
    raw = {"name": "p", "model": "tiny", "workload": "tiny-cpu", "trainer": {"accelerator": "CPU-2core"},
           "groups": [{"name": "g", "accelerator": "CPU-2core", "precision": "bf16", "kv_dtype": "bf16",
                       "emulated": True}],
           "embedded": {"eval_every": 2, "extra": {"lr": 3e-4, "eval_problems": 2, "task_options": {}}}}
    plan = plan_from_dict(raw)
    assert (plan.embedded.lr, plan.embedded.eval_problems, plan.embedded.eval_every) == (3e-4, 2, 2)
    assert plan_from_dict(plan.to_dict()) == plan                        # written back without the extra table
    assert "extra" not in plan.to_dict()["embedded"]
    with pytest.raises(SpecError, match="extra.learning_rate.*one of the \\[embedded\\] settings: .*lr"):
        plan_from_dict({**raw, "embedded": {"extra": {"learning_rate": 1e-3}}})
    with pytest.raises(SpecError, match="extra.lr.*given once"):
        plan_from_dict({**raw, "embedded": {"lr": 1e-3, "extra": {"lr": 1e-3}}})


@pytest.mark.parametrize("field, bad, message", [
    ("lr", 0, "lr"), ("loss_agg", 7, "loss_agg"), ("advantage_std", "yes", "advantage_std"),
    ("lr_warmup_steps", -1, "lr_warmup_steps"), ("task_options", [1], "task_options")])
def test_a_bad_setting_in_the_plan_is_refused_at_load(field: str, bad: object, message: str) -> None:
    raw = {"name": "p", "model": "tiny", "workload": "tiny-cpu", "trainer": {"accelerator": "CPU-2core"},
           "groups": [{"name": "g", "accelerator": "CPU-2core", "precision": "bf16", "kv_dtype": "bf16",
                       "emulated": True}],
           "embedded": {field: bad}}
    with pytest.raises(SpecError, match=message):
        plan_from_dict(raw)


def test_a_plans_loss_aggregation_is_checked_against_the_runners() -> None:
    plan = dataclasses.replace(load_plan("tiny-cpu"), embedded=dataclasses.replace(
        load_plan("tiny-cpu").embedded, loss_agg="sum"))
    with pytest.raises(ValueError, match="plan 'tiny-cpu' \\[embedded\\].*loss_agg = 'sum'; allowed: token_mean"):
        RunConfig(**BASE).resolved(plan)
    with pytest.raises(ValueError, match="RunConfig.eval_every = -1"):
        RunConfig(**BASE, eval_every=-1)


def test_no_shipped_plan_has_a_free_form_table() -> None:
    for path in sorted(Path(data_path("plans")).glob("*.toml")):
        raw = tomllib.loads(path.read_text())
        assert "extra" not in raw.get("embedded", {}), f"{path.name}: [embedded.extra] (migrate it into [embedded])"
        load_plan(path.stem)


def test_a_plan_names_the_base_it_starts_from() -> None:
    """`mixfleet run` without --init pretrains (or reuses) the base of the plan's model, task and base_steps: the
    MoE plans learn from a 300-step base (docs/learning.md), the dense ones from pretrain's default, the same cache
    entry `mixfleet pretrain` makes with its defaults."""
    from mixfleet.runner.orchestration.pretrain import PretrainConfig, cache_key, plan_base_config

    dense, moe = plan_base_config(load_plan("tiny-cpu")), plan_base_config(load_plan("tiny-moe-cpu"))
    assert cache_key(dense) == cache_key(PretrainConfig())                        # the existing cache entry
    assert (moe.model, moe.steps, moe.demos.task) == ("tiny-qwen3-moe", 300, "guess")
    assert plan_base_config(load_plan("tiny-cpu"), task="calc").demos.task == "calc"   # --task: that task's demos


def test_a_bad_base_steps_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"base_steps.*-1"):
        EmbeddedPlan(base_steps=-1)
