"""Each run setting declared once (issue 25 item 2, issue 43 item 3): the plan's [embedded] table
(`EmbeddedPlan`) owns the settings and their one check (SpecError); a run reads them through
`run_settings(plan)`, and changes one with a dotted override of its plan (runner/orchestration/recipe.py:
`mixfleet run --set embedded.lr=1.5e-4`), which the run log's plan records. `RunConfig` holds nothing that is a
plan setting. No free-form `[embedded.extra]` (a legacy one is lifted into the table at load, each key checked).

Before: the 18 settings also in `RunConfig` as overrides with other bounds and error types, merged by
`RunConfig.resolved(plan)`; the studies' override never in the run log's plan.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.paths import data_path
from mixfleet.policies.plan import EmbeddedPlan, load_plan, plan_from_dict
from mixfleet.runner.orchestration.config import RunConfig, run_settings, task_of
from mixfleet.runner.orchestration.recipe import apply_overrides, parse_settings

BASE = {"out_dir": "/nonexistent", "init_checkpoint": "/nonexistent"}


def test_the_run_settings_are_the_plans_and_an_override_goes_into_the_plan() -> None:
    plan = load_plan("tiny-cpu")
    st = run_settings(plan)
    assert (st.lr, st.lr_warmup_steps, st.loss_agg, st.advantage_std, st.eval_problems, st.eval_every,
            st.max_new_tokens, task_of(plan)) == (1.5e-4, 3, "seq_mean_token_mean", True, 32, 10, 24, "guess")
    own = apply_overrides(plan, parse_settings(["embedded.eval_every=0", "embedded.lr_warmup_steps=0",
                                                "embedded.top_k_record=0", "embedded.advantage_std=false",
                                                "embedded.eval_at_start=false", "embedded.trainer_threads=2"]))
    st = run_settings(own)
    assert (st.eval_every, st.lr_warmup_steps, st.top_k_record, st.advantage_std, st.eval_at_start,
            st.trainer_threads) == (0, 0, 0, False, False, 2)                   # 0 and false are values
    assert plan_from_dict(own.to_dict()) == own                                 # as the run log records it
    assert own.groups == plan.groups and own.policies == plan.policies
    assert run_settings(dataclasses.replace(plan, embedded=None)) == EmbeddedPlan()   # no table: the defaults


def test_run_config_holds_no_plan_setting() -> None:
    plan_fields = {f.name for f in dataclasses.fields(EmbeddedPlan)}
    assert not plan_fields & {f.name for f in dataclasses.fields(RunConfig)}
    with pytest.raises(TypeError):
        RunConfig(**BASE, lr=1e-4)   # type: ignore[call-arg]


def test_set_items_are_toml_values_and_bad_ones_name_the_flag() -> None:
    assert parse_settings(["embedded.lr=1.5e-4", "embedded.task=repo", "embedded.eval_at_start=true",
                           'embedded.task_options={task_set = "d"}']) == {
        "embedded.lr": 1.5e-4, "embedded.task": "repo", "embedded.eval_at_start": True,
        "embedded.task_options": {"task_set": "d"}}
    for bad in ("embedded.lr", "=1", "embedded..lr=1", "embedded.lr=1 embedded.lr=2"):
        with pytest.raises(SpecError, match="--set"):
            parse_settings([bad] if " " not in bad else bad.split(" "))


@pytest.mark.parametrize("key, value, field", [("embedded.lr", 0, "lr"), ("embedded.learning_rate", 1e-3,
                                                                           "learning_rate"),
                                               ("embedded.loss_agg", "sum", "loss_agg"),
                                               ("embedded.eval_top_p", 1.5, "eval_top_p")])
def test_a_bad_override_is_the_plans_one_error_naming_the_field(key: str, value: object, field: str) -> None:
    with pytest.raises(SpecError, match=field):
        apply_overrides(load_plan("tiny-cpu"), {key: value})


def test_another_task_starts_its_options_afresh_and_a_task_set_needs_the_repo_task() -> None:
    repo = load_plan("repo-cpu")
    assert run_settings(repo).task_options                                     # the plan's repo options
    assert run_settings(apply_overrides(repo, {"embedded.task": "guess"})).task_options == {}
    same = apply_overrides(repo, {"embedded.task": "repo"})
    assert run_settings(same).task_options == run_settings(repo).task_options
    with pytest.raises(SpecError, match="task_set.*needs the repo task"):
        apply_overrides(load_plan("tiny-cpu"), {"embedded.task_options.task_set": "/x"})


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
    calc = apply_overrides(load_plan("tiny-cpu"), {"embedded.task": "calc"})       # --task calc: that task's demos
    assert plan_base_config(calc).demos.task == "calc"


def test_a_bad_base_steps_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"base_steps.*-1"):
        EmbeddedPlan(base_steps=-1)
