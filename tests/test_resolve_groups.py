"""One record per plan group (costmodel/plan/resolve.py `resolve_groups`, issue 25 item 1): the twin's setup with and
without a calibration is one function (`twin.rates.build_setup`), so a calibration that covers no group changes
nothing, a calibration changes exactly the groups it covers, by one matching rule, and the planner's candidate
types take the same record."""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile

import numpy as np
import pytest
from mixfleet.costmodel.calibration.record import Calibration, Fitted, GroupCalibration
from mixfleet.costmodel.plan.planspec import resolve_groups
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.costmodel.steptime.roofline import DEFAULT_MAX_BATCH
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import group_types, metrics
from mixfleet.policies.plan import Plan, plan_from_dict
from mixfleet.twin.rates import Setup, build_setup
from mixfleet.twin.sim import simulate

# an attention-DP group (DEP4: 4 ranks, each its own scheduler) and a plain one, on a small workload
DP_PLAN = {"name": "dp", "seed": 0, "model": "qwen3-30b-a3b", "workload": "tiny-cpu", "price_table": "modal",
           "groups": [{"name": "H200-DEP4", "accelerator": "H200", "precision": "fp8", "tp": 4, "dp_attention": 4,
                       "ep": 4, "replicas": 1},
                      {"name": "H100-FP8", "accelerator": "H100", "precision": "fp8", "replicas": 1}],
           "policies": {"batcher": {"name": "fifo", "prompts_per_update": 64, "samples_per_prompt": 8,
                                    "inflight_prompts": 256}}}


def _fit(name: str, accelerator: str, precision: str, kv: str = "fp8_e4m3", kernel: str = "",
         scale: float = 1.2) -> GroupCalibration:
    return GroupCalibration(name=name, accelerator=accelerator, precision=precision, kv_dtype=kv, kernel=kernel,
                            decode_scale=Fitted(value=scale), prefill_overhead_s=Fitted(value=0.01),
                            weight_sync_s=Fitted(value=3.0), kl_k3=Fitted(value=1e-3),
                            kl_growth_per_staleness=Fitted(value=0.1), extreme_share=Fitted(value=1e-4),
                            extreme_growth_per_staleness=Fitted(value=0.0))


def _cal(*groups: GroupCalibration, trainer: str = "CPU-2core") -> Calibration:
    return Calibration(groups=groups, trainer_accelerator=trainer, trainer_gpus=1, trainer_scale=Fitted(value=0.7),
                       trainer_overhead_s=Fitted(value=0.5), update_overhead_s=Fitted(value=0.0),
                       turn_latency_s=Fitted(value=0.05), model="tiny")


def _grid(s: Setup) -> list[tuple]:
    """Every number the world reads of each group, the rates at sample points included."""
    out = []
    for g in s.groups:
        r = g.rates
        pts = [(b, c) for b in (1, 7, 100, 256, 300, r.max_running) if b <= r.max_running
               for c in (10.0, 500.0, 1024.0)]
        out.append((g.name, r.max_running, r.kv_capacity_tokens, r.price_usd_per_hour, r.cold_start_s,
                    tuple(r.decode_step_s(b, c) for b, c in pts), tuple(r.prefill_s(n) for n in (1.0, 64.0, 900.0)),
                    g.replicas, g.min_replicas, g.max_replicas, g.capacity_tokens_per_s, g.usd_per_mtoken,
                    g.weight_sync_s, g.kl_k3, g.extreme_share, g.kl_growth_per_version))
    return out


def _digest(plan: Plan, setup: Setup) -> str:
    with tempfile.TemporaryDirectory() as d:
        simulate(plan, updates=2, out=d, setup=setup)
        log, h = RunLog.open(d), hashlib.sha256()
        for t in ("trajectories", "updates", "groups", "events"):
            h.update(log.table(t).drop(columns=["run_id"], errors="ignore").to_csv(index=False).encode())
        return h.hexdigest()


def test_a_calibration_that_covers_no_group_gives_the_uncalibrated_setup() -> None:
    # main: the calibrated setup capped a DEP4 replica at 256 running requests, the uncalibrated one (and the
    # runner's fleet) at 256 per attention-DP rank, and it applied a trainer fit made on another accelerator
    plan = plan_from_dict(DP_PLAN)
    cal = _cal(_fit("cpu-fp8", "CPU-2core", "fp8"))        # covers no group of the plan, nor its B200 trainer
    prior, calibrated = build_setup(plan), build_setup(plan, calibration=cal)
    assert [g.rates.max_running for g in prior.groups] == [4 * DEFAULT_MAX_BATCH, DEFAULT_MAX_BATCH]
    assert [g.rates.max_running for g in calibrated.groups] == [4 * DEFAULT_MAX_BATCH, DEFAULT_MAX_BATCH]
    assert _grid(calibrated) == _grid(prior)
    tokens = (1e3, 1e5, 3e6)
    assert [calibrated.trainer.train_step_s(t) for t in tokens] == [prior.trainer.train_step_s(t) for t in tokens]
    assert calibrated.trainer.usd_per_hour == prior.trainer.usd_per_hour
    assert calibrated.workload == prior.workload
    assert [r.calibration for r in calibrated.resolved] == [None, None]
    assert any("trainer B200 differs" in n for n in calibrated.notes)
    assert _digest(plan, calibrated) == _digest(plan, prior)   # the same run log, table by table
    dep = build_setup(plan, calibration=_cal(_fit("H200-DEP4", "H200", "fp8")))   # the DP group calibrated
    assert dep.groups[0].rates.max_running == 4 * DEFAULT_MAX_BATCH
    assert dep.resolved[0].calibration is not None and dep.resolved[1].calibration is None


def _generated(plan_raw: dict) -> float:
    from mixfleet.costmodel.specs.workload import load_workload
    from mixfleet.planner.shape import workload_shape

    wl = load_workload(plan_raw["workload"])
    shape = workload_shape(wl, wl.samples_per_prompt)
    return wl.prompts_per_update * wl.samples_per_prompt * shape.generated_per_episode


def test_a_trainer_fit_applies_on_its_own_accelerator_in_the_twin_as_in_the_planner() -> None:
    # main: a calibrated dry run applied a trainer fit made on another accelerator (the CPU's scale on a B200
    # trainer), while the planner's screen used the prior there: the screen and its verification disagreed
    raw = {**DP_PLAN, "trainer": {"accelerator": "H100", "gpus": 8}}
    plan = plan_from_dict(raw)
    on, off = _cal(trainer="H100"), _cal(trainer="B200")
    prior = build_setup(plan)
    assert build_setup(plan, calibration=off).trainer.train_step_s(1e6) == prior.trainer.train_step_s(1e6)
    assert build_setup(plan, calibration=on).trainer.train_step_s(1e6) != prior.trainer.train_step_s(1e6)
    cfg = dict(model=plan.model, workload=plan.workload, trainer_accelerator="H100", trainer_gpus=8, verify=0)
    types = group_types(PlannerConfig(**cfg), only=list(plan.groups))
    n, k = np.full((1, len(types)), 64.0), np.array([4096])          # samplers to spare: trainer-bound
    for cal in (on, off):
        m = metrics(types, n, k, PlannerConfig(**cfg, calibration=cal))
        assert m["trainer_bound"][0]
        train_s = m["time_per_update_s"][0] - max(t.sync_s for t in types)
        assert train_s == pytest.approx(build_setup(plan, calibration=cal).trainer.train_step_s(_generated(raw)),
                                        rel=1e-12)


def test_the_twin_and_the_planner_match_calibrated_groups_by_one_rule() -> None:
    # main: the twin matched a plan group by name, else its exact key (kernel included); the planner's screen by
    # the kernel-less key, else any kernel: a screen and its twin verification could take different fits
    plan = plan_from_dict(DP_PLAN)
    other_kernel = _cal(_fit("elsewhere", "H100", "fp8", kernel="bf16", scale=1.5))   # key match, any kernel
    s = build_setup(plan, calibration=other_kernel)
    assert s.groups[1].weight_sync_s == 3.0 and s.groups[0].weight_sync_s != 3.0
    assert s.resolved[1].calibration is other_kernel.groups[0] and s.resolved[0].calibration is None
    assert s.groups[1].capacity_tokens_per_s == build_setup(plan).groups[1].capacity_tokens_per_s  # routing: prior
    prior = build_setup(plan)
    assert s.groups[1].rates.decode_step_s(16, 500.0) == pytest.approx(
        1.5 * prior.groups[1].rates.decode_step_s(16, 500.0), rel=1e-9)
    # by name first: a fit named as the planner's candidate wins over one with its key
    by_name = dataclasses.replace(_fit("H100-FP8", "H100", "fp8", kv="bf16"), weight_sync_s=Fitted(value=7.0))
    named = _cal(by_name, _fit("keyed", "H100", "fp8"))
    cfg = PlannerConfig(model=plan.model, workload=plan.workload, accelerators=("H100",),
                        precisions={"H100": ("fp8",)}, verify=0, calibration=named)
    (t,) = group_types(cfg)
    assert t.name == "H100-FP8" and t.sync_s == 7.0
    twin = build_setup(plan, calibration=named)
    assert twin.groups[1].name == "H100-FP8" and twin.groups[1].weight_sync_s == 7.0   # the same fit


def test_the_planners_types_are_the_twins_records() -> None:
    from mixfleet.costmodel.specs.workload import load_workload
    from mixfleet.planner.shape import workload_shape

    plan = plan_from_dict(DP_PLAN)
    wl = load_workload(plan.workload)
    shape = workload_shape(wl, wl.samples_per_prompt)
    cal = _cal(_fit("H100-FP8", "H100", "fp8", scale=1.3))
    for c in (None, cal):
        twin = build_setup(plan, calibration=c)
        types = group_types(PlannerConfig(model=plan.model, workload=plan.workload, verify=0, calibration=c),
                            only=list(plan.groups))
        for t, r, g in zip(types, twin.resolved, twin.groups, strict=True):
            assert t.name == g.name and t.group == r.group
            assert (t.tp, t.dp_attention, t.ep) == (r.gpus, r.replica.dp_attention, r.replica.ep)
            assert (t.sync_s, t.kl_k3, t.masked_share) == (g.weight_sync_s, g.kl_k3, g.extreme_share)
            assert t.usd_per_hour == r.replica.price_usd_per_hour == g.rates.price_usd_per_hour
            # one session's speed at batch 1 is the twin's replica's (the same model, calibrated or not)
            assert twin.models[g.name] is r.replica and g.rates.model is r.replica
            assert t.seq_speed_by_batch[0] == float(r.replica.tokens_per_s(1.0, shape.decode_context))
    assert resolve_groups(plan) == build_setup(plan).resolved
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolve_groups(plan)[0].weight_sync_s = 1.0  # type: ignore[misc]


def test_the_calibrations_duration_model_caps_a_dp_replica_as_the_twin_does() -> None:
    # main: the fit's concurrency was capped at 256 per replica, the twin's at 256 per attention-DP rank: a DEP4
    # replica running 600 sessions was fitted as if it decoded at batch 256
    import pandas as pd
    from mixfleet.costmodel.calibration.sessions import _replica_features

    rm = dataclasses.replace(build_setup(plan_from_dict(DP_PLAN)).models["H200-DEP4"], prefill_overhead_s=0.0)
    n = 600                                   # sessions decoding at once on one DEP4 replica, no prefill
    tr = pd.DataFrame({"start_s": np.zeros(n), "end_s": np.full(n, 10.0), "generated_tokens": np.full(n, 100.0),
                       "turns": np.ones(n), "prompt_tokens": np.zeros(n)})
    f = _replica_features(tr, rm, rm)
    assert f["n_mean"].iloc[0] == pytest.approx(n)
    assert f["work"].iloc[0] == pytest.approx(100.0 * float(rm.decode_step_s(float(n), 50.0)), rel=1e-12)  # L = 100/2
