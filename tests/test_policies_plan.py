"""The Plan: shipped plans load, round-trip through TOML, variants merge in one place, bad input names the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.policies.plan import load_plan, plan_from_dict, save_plan, with_overrides

SEED_GROUPS = ["B200-NVFP4", "B300-NVFP4", "H100-FP8", "H100-BF16", "H200-FP8", "H200-BF16", "A100-BF16",
               "RTX-PRO-6000-BF16"]


def test_seed_fleets_load_with_the_seeds_groups_and_trainer() -> None:
    mixed = load_plan("data/plans/seed-mixed.toml")
    assert [g.name for g in mixed.groups] == SEED_GROUPS
    assert {g.kv_dtype for g in mixed.groups} == {"fp8_e4m3"}
    assert (mixed.trainer.accelerator, mixed.trainer.precision) == ("B200", "bf16")
    homo = load_plan("seed-homogeneous")                       # a variant of seed-mixed, by shipped name
    assert [(g.accelerator, g.precision, g.kv_dtype) for g in homo.groups] == [("B200", "bf16", "bf16")]
    assert homo.trainer == mixed.trainer and homo.policies == mixed.policies


def test_tiny_cpu_plan_has_three_cpu_precisions() -> None:
    p = load_plan("tiny-cpu")
    assert [(g.precision, g.kv_dtype, g.kernel) for g in p.groups] == [
        ("bf16", "bf16", "fp32"), ("fp8", "fp8_e4m3", ""), ("nvfp4", "fp8_e4m3", "")]
    assert {g.accelerator for g in p.groups} == {"CPU-2core"}
    assert p.policies.router.name == "capacity_proportional"
    assert (p.trainer.loss, p.trainer.top_p_replay) == ("sc_mis", True)
    b = p.policies.batcher.settings
    assert (b["prompts_per_update"], b["samples_per_prompt"]) == (8, 8) and p.embedded is not None
    # the learning recipe (docs/learning.md) reaches the runner from the plan's [embedded] settings
    from mixfleet.runner.orchestration.config import run_settings

    cfg = run_settings(p)
    assert (cfg.lr, cfg.lr_warmup_steps, cfg.loss_agg, cfg.advantage_std) == (1.5e-4, 3, "seq_mean_token_mean",
                                                                               True)
    for field, bad in (("lr_warmup_steps", -1), ("loss_agg", "sum"), ("advantage_std", "yes")):
        with pytest.raises(SpecError, match=field):
            with_overrides(p, {f"embedded.{field}": bad})


def test_tiny_moe_cpu_plans_are_the_tiny_cpu_fleet_on_the_moe() -> None:
    free, replay, dense = load_plan("tiny-moe-cpu"), load_plan("tiny-moe-cpu-replay"), load_plan("tiny-cpu")
    assert free.model == replay.model == "tiny-qwen3-moe"
    assert free.groups == dense.groups and free.policies == dense.policies
    # the same run settings but the base: the MoE learns from a 300-step base (docs/learning.md, d-c300)
    assert free.embedded == dataclasses.replace(dense.embedded, base_steps=300) == replay.embedded
    assert (free.trainer.routing, replay.trainer.routing, dense.trainer.routing) == ("free", "replay", "free")
    with pytest.raises(SpecError, match="routing replay needs a MoE model"):
        with_overrides(dense, {"trainer.routing": "replay"})


def test_a_plan_round_trips_through_toml(tmp_path: Path) -> None:
    p = with_overrides(load_plan("tiny-cpu"), {"faults.preemptions_per_replica_hour": 2.5})
    again = load_plan(save_plan(p, tmp_path / "p.toml"))
    assert again == p


def test_overrides_and_base_files_merge_groups_by_name(tmp_path: Path) -> None:
    base = load_plan("seed-mixed")
    v = with_overrides(base, {"groups.H100-FP8.replicas": 4, "policies.router.name": "cost_aware",
                              "policies.router.max_backlog_s": 5.0})
    assert v.group("H100-FP8").replicas == 4 and v.group("H100-FP8").accelerator == "H100"  # other fields kept
    assert v.policies.router.name == "cost_aware" and v.policies.router.settings == {"max_backlog_s": 5.0}
    (tmp_path / "v.toml").write_text('base = "seed-mixed"\nname = "v"\nseed = 3\n'
                                     '[[groups]]\nname = "A100-BF16"\nremove = true\n'
                                     '[[groups]]\nname = "B300-NVFP4"\nreplicas = 9\nmax_replicas = 9\n')
    w = load_plan(tmp_path / "v.toml")
    assert w.seed == 3 and "A100-BF16" not in [g.name for g in w.groups]
    assert w.group("B300-NVFP4").replicas == 9 and w.group("B300-NVFP4").accelerator == "B300"


@pytest.mark.parametrize(("patch", "message"), [
    ({"groups": []}, "groups"),
    ({"colour": 1}, "colour"),
    ({"trainer": {"loss": "ppo"}}, "grpo"),
    ({"trainer": {"routing": "sticky"}}, "routing.*free, replay"),
    ({"policies": {"router": {"name": "random"}}}, "capacity_proportional"),
    ({"policies": {"scheduler": {}}}, "weight_sync"),
    ({"groups": [{"name": "a", "accelerator": "H100", "precision": "fp8", "replicas": 2, "max_replicas": 1}]},
     "max_replicas"),
    ({"groups": [{"name": "a", "accelerator": "H100", "precision": "fp8"}] * 2}, "unique"),
])
def test_bad_plans_name_the_field_and_the_allowed_values(patch: dict, message: str) -> None:
    raw = {"name": "x", "model": "tiny", "workload": "tiny-cpu",
           "groups": [{"name": "a", "accelerator": "H100", "precision": "fp8"}], **patch}
    with pytest.raises(SpecError, match=message):
        plan_from_dict(raw)
