"""The learning study of issue 41 (studies/learning_study.py, benchmarks/learning.py --study): its table, its order,
its estimates and listing. The listing's run logs are written with the real RunLogWriter. Nothing here trains.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import RunLogWriter, UpdateRecord
from mixfleet.policies.plan import load_plan
from mixfleet.studies.ablation import VARIANT_KEYS, variant
from mixfleet.studies.learning_study import (
    ARMS,
    RUN_OVERHEAD_S,
    STUDY,
    TREATMENT_NOISE,
    estimate_s,
    study_order,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def learning():
    spec = importlib.util.spec_from_file_location("learning", ROOT / "benchmarks" / "learning.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------- the table

def test_the_dense_study_is_the_issues() -> None:
    arms = {(a.fleet, a.variant): a for a in STUDY["dense"]}
    assert set(arms) == {("mixed", v) for v in VARIANT_KEYS} | {("homogeneous", "grpo"),
                                                                ("homogeneous", "sc_mis_topp")}
    key = {k for k, a in arms.items() if a.key_arm}
    assert key == {(f, v) for f in ("mixed", "homogeneous") for v in ("grpo", "sc_mis_topp")}
    for k, a in arms.items():
        assert (a.seeds, a.updates) == (((0, 1, 2, 3, 4), 60) if k in key else ((0, 1, 2), 40)), a.key
        assert a.model == "tiny" and a.pretrain_steps == 150 and a.settings == {"lr": 1.5e-4}
        loss = variant(a.variant).overrides()
        assert a.overrides == ({**loss, **TREATMENT_NOISE} if a.fleet == "mixed" else loss)
    moe = {(a.fleet, a.variant): a for a in STUDY["moe"]}
    assert set(moe) == {(f, v) for f in ("mixed", "homogeneous") for v in ("grpo", "sc_mis_topp")} | {
        ("mixed-replay", "sc_mis_topp")}
    assert all(a.seeds == (0, 1, 2) and a.model == "tiny-qwen3-moe" and a.pretrain_steps == 300
               for a in moe.values())
    assert load_plan(moe[("mixed-replay", "sc_mis_topp")].plan).trainer.routing == "replay"


def test_the_homogeneous_fleet_is_tiny_cpus_bf16_group() -> None:
    mixed = load_plan("tiny-cpu")
    bf16 = next(g for g in mixed.groups if g.name == "cpu-bf16")
    for name, model in (("learning-homog-bf16", "tiny"), ("learning-homog-bf16-moe", "tiny-qwen3-moe")):
        plan = load_plan(name)
        (g,) = plan.groups
        assert (g.precision, g.kv_dtype, g.kernel, g.replicas) == (bf16.precision, bf16.kv_dtype, bf16.kernel, 3)
        assert plan.model == model and plan.embedded.max_replicas_per_group == 3
        assert plan.embedded.lr == mixed.embedded.lr and plan.policies.batcher == mixed.policies.batcher


def test_arm_keys_never_collide_with_ladder_runs(learning) -> None:
    kept = set()
    for name in ("learning.json", "learning_treatment.json", "learning_b-lr_same_base.json"):
        kept |= {r["rung"] for r in json.loads((ROOT / "benchmarks" / "results" / name).read_text())["runs"]}
    assert kept and not kept & set(ARMS)
    assert all(learning.RUNGS[k].plan == a.plan and learning.RUNGS[k].overrides == a.overrides
               for k, a in ARMS.items())


def test_order_runs_the_key_arms_seeds_0_to_2_first_whole_seeds_at_a_time() -> None:
    order = [(a.key, s) for a, s in study_order("dense")]
    assert len(order) == len(set(order)) == 4 * 5 + 4 * 3
    first = order[:12]
    assert {ARMS[k].key_arm for k, _ in first} == {True} and [s for _, s in first] == [0] * 4 + [1] * 4 + [2] * 4
    assert {s for _, s in order[12:20]} == {3, 4} and all(ARMS[k].key_arm for k, _ in order[12:20])
    assert not any(ARMS[k].key_arm for k, _ in order[20:])
    moe = [(a.key, s) for a, s in study_order("moe")]
    assert moe[-3:] == [("m-mix-sc_mis_topp-replay", s) for s in (0, 1, 2)]
    with pytest.raises(ValueError, match="allowed: dense, moe"):
        study_order("large")


def test_estimate_is_the_like_rungs_measured_wall_per_update() -> None:
    arm = ARMS["s-mix-grpo"]
    ladder = {"runs": [{"rung": "c-lr", "status": "finished", "updates": 40, "wall_s": 400.0},
                       {"rung": "c-lr", "status": "finished", "updates": 40, "wall_s": 800.0},
                       {"rung": "c-grpo-lr", "status": "finished", "updates": 20, "wall_s": 1000.0},
                       {"rung": "c-grpo-lr", "status": "failed", "updates": 40, "wall_s": 1.0},
                       {"rung": "b-lr", "status": "finished", "updates": 40, "wall_s": 9999.0}]}
    assert estimate_s(arm, ladder) == pytest.approx(20.0 * 60 + RUN_OVERHEAD_S)     # median of 10, 20, 50 s/update
    assert math.isnan(estimate_s(arm, {"runs": []}))


def _log(folder: Path, updates: int, status: str) -> None:
    folder.mkdir(parents=True)
    w = RunLogWriter(folder, {"source": "runner", "plan": {}, "seed": 0})
    for v in range(1, updates + 1):
        w.append(UpdateRecord(version=v, start_s=v, end_s=v + 1, train_step_s=1, weight_sync_s=0, tokens=1,
                              trajectories=1, staleness_mean=0, staleness_p50=0, staleness_p95=0, staleness_max=0,
                              cost_sampler_usd=0, cost_trainer_usd=0))
    w.close(status)


def test_list_prints_the_order_estimates_and_state(learning, tmp_path: Path, capsys) -> None:
    _log(tmp_path / "s-mix-sc_mis_topp" / "seed0", 60, "finished")
    _log(tmp_path / "s-mix-grpo" / "seed0", 12, "stopped")
    assert learning.main(["--study", "dense", "--list", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line[:3].strip().isdigit()]
    assert len(rows) == 32
    assert "s-mix-sc_mis_topp/seed0" in rows[0] and rows[0].endswith("finished")
    assert "s-mix-grpo/seed0" in rows[1] and rows[1].endswith("partial (12 of 60 updates)")
    assert rows[2].endswith("new") and "s-mix-grpo_mis/seed0" in rows[20] and " 40 updates" in rows[20]
    assert any(line.startswith("estimated CPU hours:") for line in out)
