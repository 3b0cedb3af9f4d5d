"""The planner's per-accelerator overrides: prices per GPU-hour (a cheaper accelerator wins, costs scale, the
written plan carries the prices so the twin costs it the same) and allowed precisions (they restrict the
group types and the chosen groups; emulated ones only when allowed); bad values are SpecErrors naming the
field, the value and what is allowed. Tiny model and workload for speed, as in test_planner.py."""

from __future__ import annotations

import math

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import group_types
from mixfleet.planner.search import evaluate_plan, plan_mix
from mixfleet.policies.plan import Plan, load_plan, plan_from_dict, save_plan
from mixfleet.twin.checks import default_map, twin_check
from mixfleet.twin.sim import simulate

TINY = {"model": "tiny", "workload": "tiny-cpu", "accelerators": ("H100", "A100-80GB"),
        "max_gpus": {"H100": 4, "A100-80GB": 2}, "trainer_accelerator": "H100", "trainer_gpus": 1, "verify": 0}
MODAL = load_catalog("modal")


def _price(acc: str) -> float:
    return MODAL.accelerator(acc).price_usd_per_gpu_hour


def _accs(replicas: dict[str, int], types: list) -> set[str]:
    by = {t.name: t for t in types}
    return {by[g].accelerator for g in replicas}


def test_a_cheaper_price_makes_that_accelerator_win() -> None:
    base = plan_mix(PlannerConfig(**TINY))
    winner = _accs(base.best.replicas, base.types)
    assert len(winner) == 1
    other = ({"H100", "A100-80GB"} - winner).pop()
    cheap = plan_mix(PlannerConfig(**TINY, prices={other: _price(other) / 20}))
    assert _accs(cheap.best.replicas, cheap.types) == {other}
    assert cheap.best.cost_per_update_usd < base.best.cost_per_update_usd
    assert cheap.plan.prices == {other: pytest.approx(_price(other) / 20)}


def test_group_prices_and_costs_scale_with_the_override() -> None:
    base = plan_mix(PlannerConfig(**TINY))
    acc = _accs(base.best.replicas, base.types).pop()
    if acc == "H100":  # keep the trainer (an H100) at the table price so only the fleet's share scales
        pytest.fail("expected the tiny pool's cheapest mix on A100-80GB (see test_planner.py)")
    half = plan_mix(PlannerConfig(**TINY, prices={acc: _price(acc) / 2}))
    assert half.best.replicas == base.best.replicas and half.best.inflight_prompts == base.best.inflight_prompts
    for t0, t1 in zip(base.types, half.types, strict=True):
        factor = 0.5 if t0.accelerator == acc else 1.0
        assert t1.usd_per_hour == pytest.approx(t0.usd_per_hour * factor) == pytest.approx(t0.tp * _price(
            t0.accelerator) * factor)
    trainer_usd_h = _price("H100")
    fleet0 = base.best.usd_per_hour - trainer_usd_h
    assert half.best.usd_per_hour - trainer_usd_h == pytest.approx(fleet0 / 2)
    assert half.best.time_per_update_s == pytest.approx(base.best.time_per_update_s)
    assert half.best.cost_per_update_usd / base.best.cost_per_update_usd == pytest.approx(
        half.best.usd_per_hour / base.best.usd_per_hour)
    # the trainer's accelerator is priced from the same overrides
    dear_trainer = plan_mix(PlannerConfig(**TINY, prices={"H100": 2 * trainer_usd_h}))
    assert dear_trainer.best.usd_per_hour >= 2 * trainer_usd_h


def test_the_written_plan_carries_the_prices_and_the_twin_costs_it_the_same(tmp_path) -> None:
    cfg = PlannerConfig(**{**TINY, "verify": 1, "verify_updates": 2}, prices={"A100-80GB": 0.5, "B200": 9.0})
    r = plan_mix(cfg, check=twin_check, check_map=default_map)
    used = {g.accelerator for g in r.plan.groups} | {"H100"}
    assert r.plan.prices == {a: usd for a, usd in {"A100-80GB": 0.5}.items() if a in used}  # B200 unused: left out
    path = save_plan(r.plan, tmp_path / "planned.toml")
    again = load_plan(path)
    assert again.prices == r.plan.prices and "[prices]" in path.read_text()
    warm = simulate(again, updates=2, seed=cfg.seed, warm_start=True).summary  # as the planner verifies
    assert warm.steady_cost_per_update_usd == pytest.approx(r.best.verified["cost_per_update_usd"], rel=1e-12)
    cost = simulate(again, updates=2, seed=cfg.seed).summary.cost_per_update_usd
    if r.plan.prices:  # without the override the twin charges the table's price: dearer
        table = Plan(**{**{f: getattr(again, f) for f in again.__dataclass_fields__}, "prices": {}})
        assert simulate(table, updates=2, seed=cfg.seed).summary.cost_per_update_usd > cost * 1.2
    assert evaluate_plan(again).usd_per_hour == pytest.approx(r.best.usd_per_hour)


def test_allowed_precisions_restrict_the_groups() -> None:
    only_fp8 = PlannerConfig(**TINY, precisions={"h100": ["fp8"]})            # names are matched like the catalog
    assert only_fp8.precisions == {"H100": ("fp8",)}
    assert sorted(t.name for t in group_types(only_fp8)) == ["A100-80GB-BF16", "H100-FP8"]
    cheap_h100 = {"H100": _price("H100") / 20}
    for allowed in (("bf16",), ("fp8",)):
        r = plan_mix(PlannerConfig(**TINY, prices=cheap_h100, precisions={"H100": allowed}))
        assert {(g.accelerator, g.precision) for g in r.plan.groups} == {("H100", allowed[0])}
    emu = PlannerConfig(**TINY, precisions={"A100-80GB": ("fp8",)}, emulated=True)
    types = {t.name: t for t in group_types(emu)}
    assert types["A100-80GB-FP8"].emulated and not types["H100-FP8"].emulated and "A100-80GB-BF16" not in types
    r = plan_mix(PlannerConfig(**TINY, precisions={"A100-80GB": ("fp8",), "H100": ("bf16",)}, emulated=True,
                               prices={"A100-80GB": _price("A100-80GB") / 20}))
    g = next(g for g in r.plan.groups if g.accelerator == "A100-80GB")
    assert g.precision == "fp8" and g.emulated
    assert simulate(r.plan, updates=1).summary.updates == 1                   # the emulated group runs in the twin


@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"prices": {"X100": 2.0}}, "prices", "H100"),
    ({"prices": {"H100": 0}}, "prices.H100", "> 0"),
    ({"prices": {"H100": -3.0}}, "prices.H100", "> 0"),
    ({"prices": {"H100": math.nan}}, "prices.H100", "> 0"),
    ({"prices": {"H100": "cheap"}}, "prices.H100", "> 0"),
    ({"precisions": {"X100": ["fp8"]}}, "precisions", "A100-80GB"),
    ({"precisions": {"H100": ["nvfp4"]}}, "precisions.H100", "bf16, fp8 (emulated"),
    ({"precisions": {"H100": ["int3"]}}, "precisions.H100", "bf16, fp8"),
    ({"precisions": {"A100-80GB": []}}, "precisions.A100-80GB", "at least one of bf16"),
    ({"precisions": {"A100-80GB": 7}}, "precisions.A100-80GB", "a list of precision names"),
])
def test_bad_overrides_name_the_field_value_and_allowed(kwargs: dict, field: str, allowed: str) -> None:
    with pytest.raises(SpecError) as e:
        PlannerConfig(**TINY, **kwargs)
    assert e.value.field == field and allowed in str(e.value)


def test_emulated_precisions_are_refused_without_the_flag_and_unsupported_ones_always() -> None:
    PlannerConfig(**TINY, precisions={"H100": ["nvfp4"]}, emulated=True)
    with pytest.raises(SpecError, match="fp32") as e:    # the CPU format is not among an H100's options
        PlannerConfig(**TINY, precisions={"H100": ["fp32", "bf16"]}, emulated=False)
    assert e.value.value == "fp32"


def test_plan_prices_are_validated_and_unknown_accelerators_listed() -> None:
    raw = load_plan("tiny-cpu").to_dict()
    with pytest.raises(SpecError, match="prices.CPU-2core"):
        plan_from_dict({**raw, "prices": {"CPU-2core": -1.0}})
    with pytest.raises(SpecError, match="B200"):            # names the known accelerators
        simulate(plan_from_dict({**raw, "prices": {"Z9": 1.0}}), updates=1)


def test_plan_command_takes_prices_and_precisions(tmp_path) -> None:
    import json

    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    runner = CliRunner()
    args = ["plan", "--model", "tiny", "--workload", "tiny-cpu", "--accelerators", "H100,A100-80GB",
            "--max-gpus", "H100=4", "--max-gpus", "A100-80GB=2", "--trainer", "H100", "--trainer-gpus", "1",
            "--verify", "0"]
    out = tmp_path / "plan.toml"
    res = runner.invoke(app, [*args, "--price", "H100=0.2", "--price", "B200=5.5", "--precisions", "H100=bf16",
                              "--precisions", "B200=nvfp4,bf16", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "prices over the table (USD per GPU-hour): H100 0.20, B200 5.50" in res.stdout
    plan = load_plan(out)
    assert plan.prices == {"H100": 0.2}                                # B200 is neither sampler nor trainer here
    assert {(g.accelerator, g.precision) for g in plan.groups} == {("H100", "bf16")}
    js = json.loads(runner.invoke(app, [*args, "--price", "H100=0.2", "--json"]).stdout)
    assert js["best"]["usd_per_hour"] == pytest.approx(0.2 * (1 + sum(
        n for n in js["best"]["replicas"].values())))                  # 1 trainer GPU + one GPU per tiny replica
    for bad, needle in ((["--price", "H100=abc"], "ACCELERATOR=USD per GPU-hour"),
                        (["--price", "H100"], "ACCELERATOR=VALUE"),
                        (["--price", "H100=1", "--price", "H100=2"], "each accelerator once"),
                        (["--price", "X9=1"], "a known accelerator"),
                        (["--price", "H100=-1"], "prices.H100"),
                        (["--precisions", "H100=nvfp4"], "--emulated"),
                        (["--precisions", "A100-80GB="], "ACCELERATOR=VALUE")):
        res = runner.invoke(app, [*args, *bad])
        assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, (bad, res.output)
    res = runner.invoke(app, [*args, "--precisions", "H100=nvfp4", "--emulated", "--price", "H100=0.2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert {(g.precision, g.emulated) for g in load_plan(out).groups if g.accelerator == "H100"} <= {("nvfp4", True)}
