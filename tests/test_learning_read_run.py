"""benchmarks/learning.py `read_run` keeps per update what the seed's diagnosis rests on (issue 41).

A hand-written run log (the real RunLogWriter), 3 updates, two sampler groups of which "b" has no row in update 2,
trajectories with known turns / generated tokens / finish reasons: every series read_run returns is compared with
the value computed by hand here, one entry per update, NaN where a group had no row.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import EventRecord, GroupRecord, RunLogWriter, TrajectoryRecord, UpdateRecord

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def learning(benchmark_script):
    return benchmark_script("learning")


def _write(folder: Path) -> None:
    folder.mkdir(parents=True)
    with RunLogWriter(folder, {"source": "runner", "plan": {"name": "tiny-cpu"}, "seed": 0}) as w:
        w.append(EventRecord(time_s=0.0, kind="note", version=0, detail=json.dumps(
            {"eval": "pass_at_k", "k": 2, "version": 0, "pass_at_k": 0.5, "reward": 0.25, "problems": 8})))
        for v in (1, 2, 3):
            # update 3 predates the extreme_share column: the low + high split stands in for it
            w.append(UpdateRecord(version=v, start_s=v, end_s=v + 0.5, train_step_s=0.1, weight_sync_s=0.1, tokens=40,
                                  trajectories=4, staleness_mean=0, staleness_p50=0, staleness_p95=0,
                                  staleness_max=0, cost_sampler_usd=0, cost_trainer_usd=0, kl_k3=1e-3 * v,
                                  extreme_share=None if v == 3 else 0.01 * v, extreme_low_share=0.02,
                                  extreme_high_share=0.05, masked_share=0.1 * v, grad_norm=2.0 * v,
                                  entropy=1.0 - 0.1 * v, reward_mean=0.2 * v))
            for g in ("a", "b"):
                if g == "b" and v == 2:
                    continue
                w.append(GroupRecord(version=v, group=g, replicas_up=1, utilization=1, tokens_generated=10,
                                     samples=2, share_of_samples=0.5, kl_k3=(1e-3 if g == "a" else 1e-2) * v,
                                     extreme_share=(0.01 if g == "a" else 0.1) * v,
                                     masked_share=(0.02 if g == "a" else 0.2) * v))
            for i in range(4):        # turns 2, 3, 4, 5 + v; tokens 10 * turns; update v: v - 1 without a tool call
                t = 2 + i + (v if i == 3 else 0)
                w.append(TrajectoryRecord(run_id=w.run_id, prompt_id=v, sample_index=i, group="a" if i < 2 else "b",
                                          replica=0, version_start=v - 1, version_end=v - 1, turns=t,
                                          prompt_tokens=5, generated_tokens=10 * t, start_s=0, end_s=1, reward=0.0,
                                          finish_reason="no_tool_call_3x" if i < v - 1 else "done",
                                          trained_version=v))
        w.append(TrajectoryRecord(run_id=w.run_id, prompt_id=9, sample_index=0, group="a", replica=0,
                                  version_start=3, version_end=3, turns=40, prompt_tokens=5, generated_tokens=400,
                                  start_s=0, end_s=1, reward=0.0, finish_reason="done"))    # never trained on


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-9)
                                    for x, y in zip(a, b, strict=True))


def test_read_run_keeps_the_diagnosis_per_update_and_group(learning, tmp_path: Path) -> None:
    folder = tmp_path / "t-c" / "seed0"
    _write(folder)
    r = learning.read_run(folder, "t-c", 0)
    assert r["status"] == "finished" and r["updates"] == 3
    assert _close(r["grad_norm"], [2.0, 4.0, 6.0])
    assert _close(r["entropy"], [0.9, 0.8, 0.7])
    assert _close(r["masked_share"], [0.1, 0.2, 0.3])
    assert _close(r["extreme_share"], [0.01, 0.02, 0.07])            # update 3: 0.02 + 0.05
    assert _close(r["no_tool_call_share"], [0.0, 0.25, 0.5])
    assert _close(r["episode_turns"], [(2 + 3 + 4 + 6) / 4, (2 + 3 + 4 + 7) / 4, (2 + 3 + 4 + 8) / 4])
    assert _close(r["episode_generated_tokens"], [10 * x for x in r["episode_turns"]])   # the untrained one ignored
    nan = math.nan
    assert set(r["kl_k3_by_group"]) == {"a", "b"}
    assert _close(r["kl_k3_by_group"]["b"], [1e-2, nan, 3e-2])
    assert _close(r["extreme_share_by_group"]["a"], [0.01, 0.02, 0.03])
    assert _close(r["extreme_share_by_group"]["b"], [0.1, nan, 0.3])
    assert _close(r["masked_share_by_group"]["b"], [0.2, nan, 0.6])
    assert _close(r["masked_share_by_group"]["a"], [0.02, 0.04, 0.06])
    assert [e["version"] for e in r["evals"]] == [0] and r["evals"][0]["reward"] == 0.25
