"""The planner: group types from the cost model, the analytic screen's arithmetic, caps and constraints,
the Pareto set, and a DES-verified plan that loads and simulates. Tiny model and workload for speed."""

from __future__ import annotations

import numpy as np
import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.workload import load_workload
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import group_types
from mixfleet.planner.search import Binding, binds_text, pareto_mask, plan_mix, screen
from mixfleet.planner.shape import workload_shape
from mixfleet.twin.checks import twin_check
from mixfleet.twin.sim import simulate

TINY = {"model": "tiny", "workload": "tiny-cpu", "accelerators": ("H100", "A100-80GB"),
        "max_gpus": {"H100": 4, "A100-80GB": 2}, "trainer_accelerator": "H100", "trainer_gpus": 1}


def test_group_types_are_the_native_precisions_that_fit() -> None:
    names = sorted(t.name for t in group_types(PlannerConfig(**TINY)))
    assert names == ["A100-80GB-BF16", "H100-BF16", "H100-FP8"]          # no FP4 on Hopper, no FP8 on A100
    seed = group_types(PlannerConfig())
    assert {t.accelerator for t in seed} == {"B200", "B300", "H200", "H100", "A100-80GB", "RTX-PRO-6000"}
    assert all(t.tokens_per_s > 0 and t.usd_per_hour > 0 and 0 <= t.masked_share < 0.01 for t in seed)


def test_pareto_mask_keeps_exactly_the_non_dominated_points() -> None:
    pts = np.array([[1, 5, 2], [2, 4, 2], [2, 5, 2], [1, 5, 3], [3, 1, np.inf], [1, 5, 2]], dtype=float)
    assert pareto_mask(pts).tolist() == [True, True, False, False, True, True]


def test_pareto_mask_equals_the_pairwise_definition_on_random_points() -> None:
    """The front walk (lexicographic order, checked against the front so far) keeps exactly the points no
    other point dominates, ties, inf and NaN included (a NaN point is incomparable: kept, dominates nothing)."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(0, 60))
        pts = rng.integers(0, 5, size=(n, 3)).astype(float)   # few values: many ties and equal points
        if n and trial % 3 == 0:
            pts[rng.integers(0, n, size=n // 4), rng.integers(0, 3)] = np.inf
        if n and trial % 5 == 0:
            pts[rng.integers(0, n, size=n // 6), rng.integers(0, 3)] = np.nan
        dominated = [bool(((pts <= p).all(1) & (pts < p).any(1)).any()) for p in pts]
        assert pareto_mask(pts).tolist() == [not d for d in dominated], trial


def test_screen_arithmetic_for_one_candidate() -> None:
    cfg = PlannerConfig(**TINY)
    types = group_types(cfg)
    n, k, m = screen(types, cfg)
    wl = load_workload("tiny-cpu")
    i = int(np.argmin(m["cost_per_update"]))
    tps = np.array([t.tokens_per_s for t in types])
    masked = np.array([t.masked_share for t in types])
    price = np.array([t.usd_per_hour for t in types])
    share = n[i] * tps / (n[i] @ tps)
    assert m["kept_share"][i] == pytest.approx(1 - share @ masked)
    assert m["cost_per_effective_update"][i] == pytest.approx(m["cost_per_update"][i] / m["kept_share"][i])
    assert m["usd_per_hour"][i] == pytest.approx(n[i] @ price + 3.95)       # + the trainer: 1 H100 (modal)
    shape = workload_shape(wl, wl.samples_per_prompt)
    gen = wl.prompts_per_update * wl.samples_per_prompt * shape.generated_per_episode
    assert m["time_per_update_s"][i] >= gen / (n[i] @ tps) - 1e-9           # never faster than the fleet
    assert m["cost_per_update"][i] == pytest.approx(m["usd_per_hour"][i] * m["time_per_update_s"][i] / 3600)
    assert (n @ np.array([t.tp if t.accelerator == "H100" else 0 for t in types]) <= 4).all()   # GPU caps
    assert set(np.unique(k)) <= {f * wl.prompts_per_update for f in (1, 2, 3, 4, 6, 8)}


def test_constraints_bind_and_infeasible_requests_say_what_to_relax() -> None:
    free = plan_mix(PlannerConfig(**TINY, verify=0))
    bound = plan_mix(PlannerConfig(**TINY, verify=0, max_staleness=1.2))
    assert bound.best.staleness <= 1.2 < max(c.staleness for c in free.pareto)
    none = plan_mix(PlannerConfig(**TINY, verify=0, max_time_per_update_s=1e-6))
    assert none.best is None and "relax" in none.note
    with pytest.raises(SpecError, match="cost_per_effective_update"):
        PlannerConfig(objective="cheapest")


def test_what_binds_names_the_limit_whose_relaxing_buys_a_cheaper_mix() -> None:
    wide = {**TINY, "max_gpus": {}, "default_max_gpus": 64}     # caps far from the cheapest mix
    free = plan_mix(PlannerConfig(**wide, verify=0))
    assert not [b for b in free.binds if b.flag != "--max-gpus"]     # no limit set: none binds but a cap
    bound = plan_mix(PlannerConfig(**wide, verify=0, max_staleness=1.2))
    b = next(b for b in bound.binds if b.flag == "--max-staleness")
    # relaxed alone, the screen's cheapest is the unconstrained plan's, at its staleness
    assert b.relaxed_objective == pytest.approx(free.best.cost_per_update_usd)
    assert b.relaxed_value == pytest.approx(free.best.staleness) and b.relaxed_value > 1.2
    assert b.gain == pytest.approx(1 - free.best.cost_per_update_usd / bound.best.cost_per_update_usd)
    assert b.gain > 0 and "--max-staleness 1.2 binds" in b.text()
    # issue 44: the Plan page says it with its own field names, not CLI flags
    from mixfleet.ui.app_planner import PAGE_NAMES

    assert b.text(PAGE_NAMES).startswith("max mean staleness 1.2 binds") and "--" not in b.text(PAGE_NAMES)
    cap = Binding(flag="--max-gpus", what="H100", limit=8, unit="GPUs", objective=1.0, relaxed_objective=None,
                  relaxed_value=None)
    assert cap.text(PAGE_NAMES).startswith("max GPUs for H100=8") and "--" not in binds_text([cap], PAGE_NAMES)
    loose = plan_mix(PlannerConfig(**wide, verify=0, max_time_per_update_s=1e6))
    assert not [b for b in loose.binds if b.flag != "--max-gpus"]     # a limit the cheapest meets does not bind
    if not np.isfinite(free.best.staleness):   # the cheapest is trainer-bound: any staleness limit binds on it
        assert "unbounded" in b.text()
    capped = plan_mix(PlannerConfig(**TINY, verify=0))       # H100 <= 4, A100 <= 2
    used: dict[str, int] = {}
    for g, c in capped.best.replicas.items():
        t = next(t for t in capped.types if t.name == g)
        used[t.accelerator] = used.get(t.accelerator, 0) + c * t.tp
    caps = {"H100": 4, "A100-80GB": 2}
    assert {b.what for b in capped.binds if b.flag == "--max-gpus"} == {a for a, u in used.items() if u >= caps[a]}


def test_pareto_set_is_sorted_and_non_dominated() -> None:
    r = plan_mix(PlannerConfig(**TINY, verify=0))
    costs = [c.cost_per_update_usd for c in r.pareto]
    assert costs == sorted(costs) and r.best.cost_per_update_usd == pytest.approx(costs[0])
    pts = np.array([[c.cost_per_update_usd, c.time_per_update_s, c.staleness] for c in r.pareto])
    assert pareto_mask(pts).all()


def test_the_chosen_plan_is_verified_in_the_des_and_runs_again(tmp_path) -> None:
    # the planner imports no twin: a twin check is handed in
    with pytest.raises(SpecError, match="'verify' = 1 is invalid; allowed: 0, or a twin check"):
        plan_mix(PlannerConfig(**TINY, verify=1, verify_updates=2))
    r = plan_mix(PlannerConfig(**TINY, verify=1, verify_updates=2), check=twin_check)
    assert r.best.verified["updates"] == 2 and r.best.verified["time_per_update_s"] > 0
    assert r.verified == [r.best] and r.best.verified["steady_updates"] == 1
    assert [g.name for g in r.plan.groups] == list(r.best.replicas)
    again = simulate(r.plan, updates=2)
    assert again.summary.updates == 2


def test_the_analytic_model_of_a_plan_agrees_with_the_des() -> None:
    from mixfleet.planner.search import evaluate_plan
    from mixfleet.policies.plan import load_plan

    plan = load_plan("tiny-cpu")
    est = evaluate_plan(plan)
    assert list(est.replicas) == ["cpu-bf16", "cpu-fp8", "cpu-nvfp4"] and est.trainer_bound
    des = simulate(plan, updates=8).summary
    assert des.time_per_update_mean_s == pytest.approx(est.time_per_update_s, rel=0.15)
    assert des.cost_per_update_usd == pytest.approx(est.cost_per_update_usd, rel=0.15)


def test_session_limited_throughput_solves_its_fixed_point() -> None:
    """Light load (few sessions per replica): each session decodes at its replica's small-batch speed, the
    solution satisfies x = S (c - tool) / c and c = reply / (speed(x) (1 - S p / c)) + p + tool; heavy load:
    every replica at its busy tokens/s."""
    from mixfleet.planner.fleet import session_limited_throughput

    cfg = PlannerConfig(accelerators=("B300", "H100"))
    types = [t for t in group_types(cfg) if t.name in ("B300-NVFP4", "H100-FP8")]
    assert len(types) == 2 and all(len(t.seq_speed_by_batch) > 8 for t in types)
    n = np.array([[16, 4]])
    reply, tool = 525.0, 5.0
    busy = n[0] @ np.array([t.tokens_per_s for t in types])
    assert session_limited_throughput(types, n, np.array([1e6]), reply, tool)[0] == pytest.approx(busy)
    active = 256.0                                   # 16 and 4 replicas: a few sessions each
    thr = session_limited_throughput(types, n, np.array([active]), reply, tool)[0]
    tps = np.array([t.tokens_per_s for t in types])
    want = 0.0
    for j, t in enumerate(types):                    # solve one type's equations independently (bisection on x)
        s = active * n[0, j] * tps[j] / busy / n[0, j]
        speeds = np.array(t.seq_speed_by_batch)
        b = np.arange(1, len(speeds) + 1)

        def cycle(x: float, s=s, t=t, speeds=speeds, b=b) -> float:
            c = reply / np.interp(x, b, speeds) + t.prefill_turn_s + tool
            for _ in range(200):
                c = reply / (np.interp(x, b, speeds) * max(0.05, 1 - s * t.prefill_turn_s / c)) + t.prefill_turn_s \
                    + tool
            return c

        lo, hi = 1.0, float(len(speeds))
        for _ in range(60):
            x = (lo + hi) / 2
            c = cycle(x)
            lo, hi = (x, hi) if s * (c - tool) / c > x else (lo, x)
        c = cycle(lo)
        assert s < len(speeds) and s * reply / c < t.tokens_per_s          # session-limited
        assert reply / (c - t.prefill_turn_s - tool) > t.per_seq_tokens_per_s  # faster than at the busy batch
        want += n[0, j] * s * reply / c
    assert thr == pytest.approx(want, rel=0.01)
