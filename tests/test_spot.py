"""Spot capacity (issue 27 item 4): the catalog's spot prices and preemption rates (sourced, dated, estimates
marked), a plan group's `spot = true` in the twin (its replicas preempted at its rate through the one fault
process, work in flight as `on_loss` says), and the planner's `spot` choice with its expected lost work.

The planner cases use the tiny model on the tiny-cpu workload (an H100 / A100 pool at RunPod's table), so the
screen runs in seconds; the twin cases use a 3-replica tiny plan for a few updates.
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import group_types
from mixfleet.planner.search import candidate_plan, plan_mix
from mixfleet.planner.spot import expected_lost_work
from mixfleet.policies.plan import plan_from_dict
from mixfleet.twin.sim import simulate

TINY = {"model": "tiny", "workload": "tiny-cpu", "accelerators": ("H100", "A100-80GB"), "price_table": "runpod",
        "max_gpus": {"H100": 4, "A100-80GB": 2}, "trainer_accelerator": "H100", "trainer_gpus": 1, "verify": 0}


def test_catalog_spot_prices_are_sourced_dated_and_marked_as_estimates() -> None:
    cat = load_catalog("runpod")
    assert cat.spot_source.startswith("spot-2026-12") and cat.spot_date == "2026-12-01"
    assert set(cat.spot_accelerators()) == set(cat.gpus())          # every GPU of the table, not the CPU box
    for name in cat.spot_accelerators():
        on, spot = cat.accelerator(name), cat.spot(name)
        assert spot.spot and spot.price_table == "runpod-spot" and spot.price_estimate   # all estimates
        assert 0 < spot.price_usd_per_gpu_hour < on.price_usd_per_gpu_hour
        assert 0 < spot.spot_preemptions_per_hour < 1e-3                                 # AWS's monthly bands
        assert not on.spot and on.price_table == "runpod"
    assert cat.spot("h100").price_usd_per_gpu_hour == 0.99                            # names in any case
    modal = load_catalog("modal")
    assert modal.spot_accelerators() == []                                             # Modal: no spot tier
    with pytest.raises(SpecError, match=r"spot.*'H100'.*price table 'modal'.*none"):
        modal.spot("H100")


def test_planner_spot_input_errors_name_the_field() -> None:
    with pytest.raises(SpecError, match="spot.*H900"):
        PlannerConfig(**TINY, spot=("H900",))
    with pytest.raises(SpecError, match="spot.*all.*'modal' has none"):
        PlannerConfig(**{**TINY, "price_table": "modal"}, spot=("all",))
    with pytest.raises(SpecError, match="on_loss.*'retry'.*resume"):
        PlannerConfig(**TINY, on_loss="retry")
    with pytest.raises(SpecError, match="spot_preemptions_per_hour.*-1"):
        PlannerConfig(**TINY, spot=("H100",), spot_preemptions_per_hour=-1)
    assert PlannerConfig(**TINY, spot="all").spot == tuple(load_catalog("runpod").spot_accelerators())
    with pytest.raises(SpecError, match="plan group 'g'.*spot.*true or false"):
        plan_from_dict({**_plan(rate=1.0), "groups": [{"name": "g", "accelerator": "H100", "precision": "fp8",
                                                       "spot": "yes"}]})


def _plan(rate: float, *, spot: bool = True, on_loss: str = "resume", faults_rate: float = 0.0) -> dict:
    return {"name": "spot-test", "model": "tiny", "workload": "tiny-cpu", "price_table": "runpod", "seed": 3,
            "trainer": {"accelerator": "H100", "gpus": 1},
            "groups": [{"name": "h100", "accelerator": "H100", "precision": "fp8", "replicas": 2, "spot": spot},
                       {"name": "a100", "accelerator": "A100-80GB", "precision": "bf16", "replicas": 1}],
            "faults": {"spot_preemptions_per_replica_hour": rate, "on_loss": on_loss,
                       "preemptions_per_replica_hour": faults_rate}}


def _preempts(log) -> pd.DataFrame:  # noqa: ANN001
    e = pd.read_parquet(log / "events")
    return e[e.kind == "preempt"][["time_s", "group", "replica"]].reset_index(drop=True)


def test_twin_preempts_only_the_spot_group_at_its_rate_and_bills_the_spot_price(tmp_path) -> None:  # noqa: ANN001
    r = simulate(plan_from_dict(_plan(rate=200.0)), updates=6, out=tmp_path / "spot")
    pre = _preempts(tmp_path / "spot")
    assert len(pre) >= 1 and set(pre.group) == {"h100"}                  # the on-demand group is never preempted
    assert r.turns_lost >= 1 and r.sessions_restarted == 0             # resume: the cut turns go on elsewhere
    ondemand = simulate(plan_from_dict(_plan(rate=200.0, spot=False)), updates=6, out=tmp_path / "od")
    assert _preempts(tmp_path / "od").empty and ondemand.turns_lost == 0  # no spot group: no preemption at all
    groups = pd.read_parquet(tmp_path / "od" / "groups")
    assert "h100" in set(groups.group)
    restart = simulate(plan_from_dict(_plan(rate=200.0, on_loss="restart")), updates=6)
    assert restart.sessions_restarted >= 1                             # restart: the trajectory starts over


def test_a_spot_rate_is_the_faults_rate_for_its_group_one_mechanism(tmp_path) -> None:  # noqa: ANN001
    """The spot group's own rate goes through the one fault process: a plan whose groups are all spot at rate
    r preempts exactly as the same plan on demand with [faults] preemptions_per_replica_hour = r (same draws)."""
    both_spot = _plan(rate=150.0)
    both_spot["groups"][1]["spot"] = True
    simulate(plan_from_dict(both_spot), updates=4, out=tmp_path / "a")
    simulate(plan_from_dict(_plan(rate=0.0, spot=False, faults_rate=150.0)), updates=4, out=tmp_path / "b")
    a, b = _preempts(tmp_path / "a"), _preempts(tmp_path / "b")
    assert len(a) >= 1 and a.equals(b)


def test_planner_offers_spot_groups_priced_and_discounted_by_their_preemptions() -> None:
    cfg = PlannerConfig(**TINY, spot=("H100",))
    types = {t.name: t for t in group_types(cfg)}
    cat = load_catalog("runpod")
    spot, od = types["H100-FP8-SPOT"], types["H100-FP8"]
    assert spot.spot and not od.spot and "A100-80GB-BF16-SPOT" not in types   # only the named accelerator
    assert spot.usd_per_hour == pytest.approx(spot.tp * cat.spot("H100").price_usd_per_gpu_hour)
    assert od.usd_per_hour == pytest.approx(od.tp * cat.accelerator("H100").price_usd_per_gpu_hour)
    rate = cat.spot("H100").spot_preemptions_per_hour
    assert spot.preemptions_per_hour == rate and od.preemptions_per_hour == 0 and od.loss_share == 0
    assert spot.loss_share == pytest.approx(rate / 3600 * (spot.replace_s + spot.inflight_loss_s))
    assert spot.replace_s > 0 and spot.inflight_loss_s > 0

    r = plan_mix(cfg)          # at the catalog's (AWS-band) rate, spot H100s undercut every on-demand mix
    assert all(types[g].spot for g in r.best.replicas)
    assert r.on_demand is not None and not any(types[g].spot for g in r.on_demand.replicas)
    assert r.best.cost_per_update_usd < r.on_demand.cost_per_update_usd
    lw = r.best.lost_work
    n = sum(r.best.replicas.values())
    assert lw["preemptions_per_update"] == pytest.approx(n * rate * r.best.time_per_update_s / 3600)
    assert lw["lost_replica_s_per_update"] == pytest.approx(
        lw["preemptions_per_update"] * (spot.replace_s + spot.inflight_loss_s))
    assert r.on_demand.lost_work["preemptions_per_update"] == 0
    plan = r.plan.to_dict()
    assert all(g["spot"] for g in plan["groups"]) and plan["faults"]["on_loss"] == "resume"

    stormy = plan_mix(PlannerConfig(**TINY, spot=("H100",), spot_preemptions_per_hour=3000.0))
    assert not any(types[g].spot for g in stormy.best.replicas)   # preempted every ~1 s: not worth it


def test_on_loss_restart_costs_more_in_flight_work_and_is_written_into_the_plan() -> None:
    resume = {t.name: t for t in group_types(PlannerConfig(**TINY, spot=("H100",)))}
    restart_cfg = PlannerConfig(**TINY, spot=("H100",), on_loss="restart", spot_preemptions_per_hour=2.0)
    restart = {t.name: t for t in group_types(restart_cfg)}
    assert restart["H100-FP8-SPOT"].inflight_loss_s != resume["H100-FP8-SPOT"].inflight_loss_s
    assert restart["H100-FP8-SPOT"].preemptions_per_hour == 2.0
    c = plan_mix(restart_cfg).best
    plan = candidate_plan(c, list(restart.values()), restart_cfg)
    assert plan.faults.on_loss == "restart" and plan.faults.spot_preemptions_per_replica_hour == 2.0
    lw = expected_lost_work(c, list(restart.values()), restart_cfg)
    assert lw["on_loss"] == "restart" and math.isfinite(lw["lost_share"])
