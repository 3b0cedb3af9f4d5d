"""RunSummary numbers checked against values computed by hand on a small constructed run log, the empty
log, and `compare` (differences, relative differences, groups present on one side only)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from mixfleet.costmodel.records.runlog import (
    FINISH_REASONS,
    GroupRecord,
    RunLog,
    RunLogWriter,
    TrajectoryRecord,
    UpdateRecord,
)
from mixfleet.costmodel.records.runsummary import RunSummary, batch_means, compare, mser_truncation, summarize

NAN = float("nan")


def small_log(path: Path, *, scale_cost: float = 1.0, source: str = "twin", extra_group: bool = False) -> Path:
    """3 updates ending at 10, 25, 45 s; two groups a (2 replicas) and b (1 replica); 4 trajectories."""
    w = RunLogWriter(path, {"source": source, "run_id": path.name, "wall_s": 0.5})
    ends = (10.0, 25.0, 45.0)
    tokens = (100, 200, 100)
    kl3 = (0.01, None, 0.03)
    ext = ((0.01, 0.0), (0.02, 0.01), (None, None))
    for i, (end, tok) in enumerate(zip(ends, tokens, strict=True)):
        v = i + 1
        w.append(UpdateRecord(
            version=v, start_s=end - 3, end_s=end, train_step_s=2.0, weight_sync_s=1.0, tokens=tok, trajectories=4,
            staleness_mean=float(i), staleness_p50=float(i), staleness_p95=float(i) + 0.5, staleness_max=float(2 * i),
            cost_sampler_usd=3.0 * v * scale_cost, cost_trainer_usd=1.0 * v * scale_cost, kl_k1=None, kl_k3=kl3[i],
            extreme_low_share=ext[i][0], extreme_high_share=ext[i][1], reward_mean=(0.1, 0.2, 0.4)[i],
            pass_at_k=0.25 if v == 2 else None))
        # group a: samples 3,3,2 ; group b: 1,1,2
        sa, sb = (3, 3, 2)[i], (1, 1, 2)[i]
        w.append(GroupRecord(version=v, group="a", replicas_up=2.0, utilization=0.5, tokens_generated=100, samples=sa,
                             share_of_samples=sa / 4, kl_k3=0.01, extreme_share=0.02, cost_usd=2.0,
                             staleness_mean=1.0, tokens_trained=(60, 0, 20)[i]))
        w.append(GroupRecord(version=v, group="b", replicas_up=1.0, utilization=0.8, tokens_generated=50, samples=sb,
                             share_of_samples=sb / 4, kl_k3=0.04 * (i + 1), extreme_share=None, cost_usd=1.0))
        if extra_group:
            w.append(GroupRecord(version=v, group="c", replicas_up=1.0, utilization=1.0, tokens_generated=0,
                                 samples=0, share_of_samples=0.0))
    for j, (reason, restarts, turns) in enumerate((("done", 0, 2), ("done", 0, 4), ("max_turns", 0, 6),
                                                  ("restarted", 2, 8))):
        w.append(TrajectoryRecord(run_id=path.name, prompt_id=j, sample_index=0, group="a", replica=0,
                                  version_start=0, version_end=1, turns=turns, prompt_tokens=10, generated_tokens=20,
                                  start_s=0.0, end_s=5.0, reward=1.0, finish_reason=reason, restarts=restarts))
    w.close()
    return path


def test_summary_matches_hand_computed_values(tmp_path: Path) -> None:
    s = summarize(RunLog.open(small_log(tmp_path / "run")))
    assert (s.run_id, s.source, s.clock, s.updates, s.trajectories) == ("run", "twin", "simulated", 3, 4)
    assert s.elapsed_s == 45.0 and s.wall_s == 0.5
    # intervals 10, 15, 20
    assert s.time_per_update_mean_s == pytest.approx(15.0)
    assert s.time_per_update_p50_s == pytest.approx(15.0)
    assert s.time_per_update_p95_s == pytest.approx(19.5)  # 15 + 0.9 * (20 - 15)
    assert s.first_update_s == 10.0
    # cumulative costs 9 and 3 after 3 updates
    assert s.cost_sampler_per_update_usd == pytest.approx(3.0)
    assert s.cost_trainer_per_update_usd == pytest.approx(1.0)
    assert s.cost_per_update_usd == pytest.approx(4.0) and s.cost_total_usd == pytest.approx(12.0)
    # staleness: token-weighted (0*100 + 1*200 + 2*100) / 400; p95 mean of 0.5, 1.5, 2.5; max 4
    assert s.staleness_mean == pytest.approx(1.0)
    assert s.staleness_p95 == pytest.approx(1.5) and s.staleness_max == 4.0
    # busy 3 x (2 + 1) = 9 of 45 s
    assert s.trainer_idle_share == pytest.approx(0.8)
    # tokens: groups 3 x (100 + 50) = 450 generated over 45 s; 400 trained
    assert s.tokens_generated == 450 and s.tokens_trained == 400
    assert s.tokens_per_s == pytest.approx(10.0)
    # utilization weighted by replicas: (3*2*0.5 + 3*1*0.8) / 9
    assert s.utilization == pytest.approx(0.6)
    # KL k3 over updates with it: (0.01*100 + 0.03*100) / 200 ; extreme: (0.01*100 + 0.03*200) / 300
    assert s.kl_k3 == pytest.approx(0.02) and math.isnan(s.kl_k1) and math.isnan(s.masked_share)
    assert s.extreme_share == pytest.approx(7.0 / 300)
    # reward 0.1, 0.2, 0.4 at versions 1, 2, 3: slope 0.15
    assert s.reward_first == pytest.approx(0.1) and s.reward_last == pytest.approx(0.4)
    assert s.reward_slope_per_update == pytest.approx(0.15)
    assert s.pass_at_k_last == 0.25
    assert s.restarts == 2 and s.turns_mean == pytest.approx(5.0)
    assert s.finish_reasons == {r: {"done": 0.5, "max_turns": 0.25, "restarted": 0.25}.get(r, 0.0)
                                for r in FINISH_REASONS}
    # groups: samples a 8, b 4
    assert s.groups == ["a", "b"]
    assert s.group_share_of_samples == pytest.approx({"a": 8 / 12, "b": 4 / 12})
    assert s.group_tokens_per_s == pytest.approx({"a": 300 / 45, "b": 150 / 45})
    assert s.group_utilization == pytest.approx({"a": 0.5, "b": 0.8})
    assert s.group_replicas_mean == pytest.approx({"a": 2.0, "b": 1.0})
    assert s.group_cost_usd == pytest.approx({"a": 6.0, "b": 3.0})
    # a: weighted by tokens_trained 60, 0, 20 (constant values); b: no tokens -> weighted by samples 1, 1, 2
    assert s.group_kl_k3["a"] == pytest.approx(0.01)
    assert s.group_kl_k3["b"] == pytest.approx((0.04 * 1 + 0.08 * 1 + 0.12 * 2) / 4)
    assert s.group_extreme_share["a"] == pytest.approx(0.02) and math.isnan(s.group_extreme_share["b"])
    assert s.group_staleness_mean["a"] == pytest.approx(1.0) and math.isnan(s.group_staleness_mean["b"])
    d = s.to_dict()
    assert d["group_share_of_samples"]["a"] == pytest.approx(8 / 12) and d["updates"] == 3
    assert s.flat()["group_share_of_samples[b]"] == pytest.approx(4 / 12)


def test_summary_of_an_empty_log_and_of_a_path(tmp_path: Path) -> None:
    RunLogWriter(tmp_path / "e", {"source": "runner"}).close()
    s = summarize(tmp_path / "e")
    assert isinstance(s, RunSummary) and s.updates == 0 and s.trajectories == 0 and s.elapsed_s == 0.0
    assert s.clock == "wall" and s.wall_s == 0.0
    assert math.isnan(s.time_per_update_mean_s) and math.isnan(s.cost_per_update_usd)
    assert math.isnan(s.trainer_idle_share) and math.isnan(s.staleness_mean) and s.group_share_of_samples == {}
    assert set(s.finish_reasons) == set(FINISH_REASONS)


def test_compare_reports_differences(tmp_path: Path) -> None:
    a = summarize(small_log(tmp_path / "a"))
    b = summarize(small_log(tmp_path / "b", scale_cost=1.5, source="runner", extra_group=True))
    df = compare(a, b, labels=("predicted", "measured"))
    assert list(df.columns) == ["metric", "predicted", "measured", "diff", "rel_diff"]
    row = df.set_index("metric").loc["cost_per_update_usd"]
    assert row["predicted"] == pytest.approx(4.0) and row["measured"] == pytest.approx(6.0)
    assert row["diff"] == pytest.approx(2.0) and row["rel_diff"] == pytest.approx(0.5)
    idx = df.set_index("metric")
    assert idx.loc["elapsed_s", "rel_diff"] == 0.0
    # group c exists only in b; in b all samples still come from a and b
    assert math.isnan(idx.loc["group_share_of_samples[c]", "predicted"])
    assert idx.loc["group_share_of_samples[c]", "measured"] == 0.0
    assert math.isnan(idx.loc["group_share_of_samples[c]", "rel_diff"])
    assert math.isnan(idx.loc["kl_k1", "rel_diff"])
    assert df.attrs["run_ids"] == ("a", "b") and df.attrs["sources"] == ("twin", "runner")
    same = compare(a, a)
    assert (same["diff"].dropna() == 0).all() and (same["rel_diff"].dropna() == 0).all()
    with pytest.raises(ValueError, match="labels"):
        compare(a, b, labels=("x", "x"))


def test_steady_state_of_the_small_log_by_hand(tmp_path: Path) -> None:
    """Intervals 10 | 15, 20: the first is the pipeline fill; 2 steady updates, 2 batches of 1 (t(0.975, 1) =
    12.706); cost increments 4, 4, 4 (interval 0); staleness 1, 2."""
    s = summarize(RunLog.open(small_log(tmp_path / "run")))
    assert (s.first_update_s, s.warmup_updates, s.steady_updates) == (10.0, 1, 2)
    assert s.steady_time_per_update_s == pytest.approx(17.5)
    assert s.steady_time_per_update_ci_s == pytest.approx(12.7062 * 2.5, rel=1e-4)  # sd(15, 20) / sqrt(2) = 2.5
    assert s.steady_cost_per_update_usd == pytest.approx(4.0) and s.steady_cost_per_update_ci_usd == pytest.approx(0)
    assert s.steady_cost_sampler_per_update_usd == pytest.approx(3.0)
    assert s.steady_staleness_mean == pytest.approx(1.5)
    assert s.steady_tokens_per_s == pytest.approx(300 / 35)
    assert compare(s, s)["metric"].str.startswith("steady_").sum() == 12  # + the sandbox part and its interval


def test_mser_cuts_the_transient_and_keeps_a_stationary_series() -> None:
    rng = np.random.default_rng(0)
    ramp = np.r_[np.linspace(10.0, 2.0, 15), 1.0 + 0.1 * rng.standard_normal(85)]
    d = mser_truncation(ramp)
    assert 10 <= d <= 25 and d % 5 == 0  # MSER-5 deletes whole batches of 5 past the ramp
    assert mser_truncation(1.0 + 0.1 * rng.standard_normal(100)) <= 10
    assert mser_truncation([5.0, 1.0, 1.1, 0.9, 1.0, 1.05, 0.95]) == 1  # short: batches of 1
    assert mser_truncation([3.0, 1.0, 2.0]) == 0


def test_batch_means_interval_covers_the_mean_about_95_percent() -> None:
    """AR(1) series (phi 0.5): batch means of 10 batches cover the true mean in ~95% of 400 replications."""
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(400):
        e = rng.standard_normal(200)
        x = np.empty(200)
        x[0] = e[0]
        for i in range(1, 200):
            x[i] = 0.5 * x[i - 1] + e[i]
        est = batch_means(3.0 + x)
        assert est.batches == 10 and est.n == 200
        hits += est.contains(3.0)
    assert 0.88 <= hits / 400 <= 0.99
    one = batch_means([2.0])
    assert one.mean == 2.0 and math.isnan(one.half_width)
