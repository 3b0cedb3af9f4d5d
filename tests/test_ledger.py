"""The update ledger (costmodel/records/ledger.py): one meaning per `updates` / `groups` column in both worlds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mixfleet.costmodel.records.ledger import GroupBatch, GroupTotals, Ledger, weight_push_detail
from mixfleet.costmodel.records.runlog import RunLog, extreme_shares
from mixfleet.twin.sim import simulate

STALENESS = {"staleness_mean": 0.5, "staleness_p50": 0.0, "staleness_p95": 1.0, "staleness_max": 1.0}


def _record(ledger: Ledger, version: int, now: float, totals: dict[str, GroupTotals]) -> tuple:
    return ledger.record(version=version, now_s=now, start_s=now - 1.0, totals=totals,
                         batches={"a": GroupBatch(samples=3, tokens_trained=30), "b": GroupBatch(samples=1)},
                         train_step_s=1.0, weight_sync_s=0.0, tokens=30, trajectories=4, staleness=STALENESS)


def test_window_rows_are_time_means_and_costs_accumulate() -> None:
    ledger = Ledger(["a", "b"], trainer_usd_per_hour=36.0)
    # over [0, 10] s group a had 2 replicas up for 5 s and 1 for 5 s (15 replica-s), busy 6 s; b none up
    up, rows = _record(ledger, 1, 10.0, {"a": GroupTotals(up_replica_s=15.0, cost_usd=3.0, busy_s=6.0,
                                                          tokens_generated=100),
                                         "b": GroupTotals(cost_usd=0.5)})
    a, b = rows
    assert (a.replicas_up, a.utilization, a.cost_usd, a.tokens_generated) == (1.5, 0.4, 3.0, 100)
    assert (b.replicas_up, b.utilization, b.share_of_samples) == (0.0, 0.0, 0.25)
    assert up.cost_sampler_usd == 3.5 and up.cost_trainer_usd == pytest.approx(0.1)   # 36 USD/h x 10 s
    up, rows = _record(ledger, 2, 20.0, {"a": GroupTotals(up_replica_s=25.0, cost_usd=5.0, busy_s=16.0,
                                                          tokens_generated=150),
                                         "b": GroupTotals(cost_usd=0.5)})
    assert (rows[0].replicas_up, rows[0].utilization, rows[0].cost_usd, rows[0].tokens_generated) == (1.0, 1.0, 2.0, 50)
    assert up.cost_sampler_usd == 5.5 and up.cost_trainer_usd == pytest.approx(0.2)


def test_a_resumed_run_carries_its_cost_on() -> None:
    ledger = Ledger(["a", "b"], trainer_usd_per_hour=0.0)
    totals = {"a": GroupTotals(cost_usd=2.0), "b": GroupTotals(cost_usd=1.0)}
    state = ledger.state(totals)
    assert state == {"cost_usd_by_group": {"a": 2.0, "b": 1.0}}
    resumed = Ledger(["a", "b"], trainer_usd_per_hour=0.0)
    resumed.restore(json.loads(json.dumps(state)), now_s=30.0)
    up, rows = _record(resumed, 3, 40.0, {"a": GroupTotals(up_replica_s=10.0, cost_usd=0.25),
                                          "b": GroupTotals()})
    assert up.cost_sampler_usd == 3.25 and rows[0].replicas_up == 1.0 and rows[0].cost_usd == 0.25
    old = Ledger(["a", "b"], trainer_usd_per_hour=0.0)
    old.restore({"cost_sampler_usd": 3.0}, now_s=30.0)                # a checkpoint from before the ledger
    assert _record(old, 3, 40.0, {"a": GroupTotals(), "b": GroupTotals()})[0].cost_sampler_usd == 3.0


def test_weight_push_detail_is_json_with_a_known_mode() -> None:
    assert json.loads(weight_push_detail("drain", 2, 1)) == {"mode": "drain", "replicas": 2, "loaded": 1}
    with pytest.raises(ValueError, match="allowed: drain, in_flight"):
        weight_push_detail("eager", 1, 1)


def test_the_twin_writes_the_ledgers_columns(tmp_path: Path) -> None:
    simulate("tiny-cpu", updates=3, seed=0, out=tmp_path / "log")
    log = RunLog.open(tmp_path / "log")
    up, gr, ev = log.updates, log.groups, log.events
    assert up["extreme_share"].notna().all() and up["extreme_low_share"].isna().all()   # no split: not halved
    assert (extreme_shares(up) == up["extreme_share"]).all()
    fresh = gr[gr["tokens_on_policy"] > 0]
    assert len(fresh) and fresh["kl_k3_on_policy"].notna().all()
    assert (fresh["kl_k3_on_policy"] <= fresh["kl_k3"]).all()        # the prior grows with staleness
    pushes = [json.loads(d) for d in ev[ev["kind"] == "weight_push"]["detail"]]
    assert pushes and all(p["mode"] == "in_flight" and p["loaded"] == p["replicas"] for p in pushes)
    assert (up["cost_trainer_usd"] > 0).all()


def test_old_logs_read_their_extreme_share_from_low_and_high() -> None:
    import pandas as pd

    up = pd.DataFrame({"extreme_share": [math.nan, 0.3], "extreme_low_share": [0.1, math.nan],
                       "extreme_high_share": [0.2, math.nan]})
    assert extreme_shares(up).tolist() == pytest.approx([0.3, 0.3])


def test_the_runners_replica_seconds_are_integrated_over_the_clock() -> None:
    from mixfleet.runner.orchestration.sampler_fleet import ReplicaSeconds

    rs = ReplicaSeconds(0.0)
    rs.set(0.0, up=0, billed=1)          # a replica starting (billed, not up)
    rs.set(4.0, up=1, billed=1)          # ready after 4 s
    rs.set(10.0, up=2, billed=3)         # a second one up, a third starting
    rs.advance(12.0)
    assert (rs.up_s, rs.billed_s) == (6.0 + 4.0, 4.0 + 6.0 + 6.0)


def test_weight_push_detail_timings() -> None:
    d = json.loads(weight_push_detail("in_flight", 2, 2, publish_s=0.1, transfer_s=0.2, load_s=0.3, nodes=2))
    assert d == {"mode": "in_flight", "replicas": 2, "loaded": 2, "publish_s": 0.1, "transfer_s": 0.2,
                 "load_s": 0.3, "nodes": 2}
    with pytest.raises(ValueError, match="unknown bytes"):
        weight_push_detail("drain", 1, 1, bytes=5)
