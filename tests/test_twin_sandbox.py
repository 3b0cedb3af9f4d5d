"""Sandboxes in the twin and the planner (issue 42): hand-computed timelines of the twin's pool (start latency,
FIFO queueing at the cap, billing of every live sandbox, commands inside the sandbox), the run log's and the
summary's sandbox figures, the [sandbox] plan table and its price, and the planner's sandbox model (Little's
law at the cap, the split of cost per update, what binds)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.plan.planspec import ResolvedSandbox, SandboxPlan, resolve_sandbox
from mixfleet.costmodel.records.runlog import RunLog, RunLogWriter
from mixfleet.costmodel.specs.catalog import sandbox_price
from mixfleet.costmodel.specs.workload import workload_from_dict
from mixfleet.policies.plan import plan_from_dict
from mixfleet.policies.prompt_buffer import PromptGroup
from mixfleet.twin.episodes import Episode
from mixfleet.twin.rates import FixedRates, Setup
from mixfleet.twin.sim import simulate
from mixfleet.twin.world import GroupSetup, Session, TrainerSetup, World

USD_PER_S = 3600.0        # a sandbox price of 3600 USD/h: one USD per sandbox-second, so cost = seconds


def workload(**kw):
    raw = {"name": "w", "prompts_per_update": 1, "samples_per_prompt": 2, "max_context": 1_000_000, "turns": 1,
           "prompt_tokens": 10, "reply_tokens": 100, "tool_output_tokens": 0, "tool_latency_s": 0.0,
           "success_prob": 1.0}
    return workload_from_dict({**raw, **kw})


def gsetup() -> GroupSetup:
    # decode 100 tokens/s per session at any batch (step 0.01 s, no per-sequence cost), no prefill time
    return GroupSetup(name="g", rates=FixedRates(step_s=0.01), replicas=1, min_replicas=1, max_replicas=1,
                      capacity_tokens_per_s=100.0, usd_per_mtoken=1.0, weight_sync_s=0.0)


def plan(**kw):
    return plan_from_dict({"name": "t", "model": "tiny", "workload": "tiny-cpu",
                           "groups": [{"name": "g", "accelerator": "H100", "precision": "bf16"}], **kw})


def pool(max_live: int, start_s: float) -> ResolvedSandbox:
    return ResolvedSandbox(max_live=max_live, start_s=start_s, usd_per_hour=USD_PER_S, price_source="test")


def world(tmp_path: Path, sandbox: ResolvedSandbox | None) -> World:
    w = World(groups=[gsetup()], trainer=TrainerSetup(train_step_s=lambda n: 1.0, usd_per_hour=0.0),
              workload=workload(), policies=plan().build_policies(), seed=0,
              writer=RunLogWriter(tmp_path / "log", {"source": "twin"}), run_id="t", sandbox=sandbox)
    w.admit_prompts = lambda: None  # only the sessions a test injects run
    return w


def ep(replies: list[int], tool_s: list[float] | None = None) -> Episode:
    n = len(replies)
    return Episode(turns=n, prompt_tokens=0, reply_tokens=tuple(replies), tool_tokens=(0,) * (n - 1),
                   tool_s=tuple(tool_s or [0.0] * (n - 1)), reward=1.0, finish_reason="done")


def inject(w: World, sid: int, e: Episode, at_s: float) -> Session:
    s = Session(sid=sid, prompt_id=sid, sample=0, ep=e)
    w.prompts.inflight[sid] = PromptGroup(prompt_id=sid, expected=1)
    w.env.timeout(at_s).callbacks.append(lambda _e: w._begin(s))
    return s


def test_an_episode_starts_its_sandbox_before_its_first_turn(tmp_path: Path) -> None:
    w = world(tmp_path, pool(max_live=4, start_s=5.0))
    s = inject(w, 0, ep([100]), at_s=1.0)
    w.env.run(until=50)
    # asks at 1; its sandbox starts for 5 s (1..6); 100 tokens at 100 tokens/s (6..7); given back at 7
    assert s.start_s == pytest.approx(1.0) and s.end_s == pytest.approx(7.0)
    assert w.sandbox.done[0] == pytest.approx((0.0, 6.0))           # (pool wait, sandbox held)
    assert w.sandbox.live == 0
    w.sandbox.accrue(w.env.now)
    assert w.sandbox.cost_usd == pytest.approx(6.0)                 # 6 sandbox-seconds, starting included


def test_commands_run_inside_the_held_sandbox(tmp_path: Path) -> None:
    w = world(tmp_path, pool(max_live=1, start_s=2.0))
    s = inject(w, 0, ep([50, 20], tool_s=[4.0]), at_s=0.0)
    w.env.run(until=50)
    # start 0..2, reply 50 tokens 2..2.5, command 4 s 2.5..6.5, reply 20 tokens 6.5..6.7
    assert s.end_s == pytest.approx(6.7)
    assert w.sandbox.done[0] == pytest.approx((0.0, 6.7))
    w.sandbox.accrue(w.env.now)
    assert w.sandbox.cost_usd == pytest.approx(6.7)


def test_episodes_queue_in_order_when_the_cap_binds(tmp_path: Path) -> None:
    w = world(tmp_path, pool(max_live=1, start_s=2.0))
    a = inject(w, 0, ep([100]), at_s=0.0)
    b = inject(w, 1, ep([100]), at_s=0.5)
    c = inject(w, 2, ep([100]), at_s=1.0)
    w.env.run(until=50)
    # one sandbox: a holds it 0..3 (start 0..2, turn 2..3); b asked at 0.5, takes it at 3 (start 3..5, turn 5..6);
    # c asked at 1, takes it at 6 (start 6..8, turn 8..9). Never more than one live: 9 sandbox-seconds.
    assert (a.end_s, b.end_s, c.end_s) == pytest.approx((3.0, 6.0, 9.0))
    assert (a.start_s, b.start_s, c.start_s) == pytest.approx((0.0, 0.5, 1.0))   # a trajectory starts when it asks
    assert w.sandbox.done == {0: pytest.approx((0.0, 3.0)), 1: pytest.approx((2.5, 3.0)),
                              2: pytest.approx((5.0, 3.0))}
    w.sandbox.accrue(w.env.now)
    assert w.sandbox.cost_usd == pytest.approx(9.0)


def test_below_the_cap_no_one_waits_and_each_live_sandbox_is_billed(tmp_path: Path) -> None:
    w = world(tmp_path, pool(max_live=2, start_s=2.0))
    a = inject(w, 0, ep([100]), at_s=0.0)
    b = inject(w, 1, ep([300]), at_s=0.0)
    w.env.run(until=50)
    # both start 0..2; a's 100 tokens 2..3, b's 300 tokens 2..5: 3 + 5 sandbox-seconds
    assert (a.end_s, b.end_s) == pytest.approx((3.0, 5.0))
    assert w.sandbox.done == {0: pytest.approx((0.0, 3.0)), 1: pytest.approx((0.0, 5.0))}
    w.sandbox.accrue(w.env.now)
    assert w.sandbox.cost_usd == pytest.approx(8.0)


def test_without_sandboxes_nothing_changes(tmp_path: Path) -> None:
    w = world(tmp_path, None)
    s = inject(w, 0, ep([100]), at_s=1.0)
    w.env.run(until=50)
    assert (s.start_s, s.end_s) == pytest.approx((1.0, 2.0)) and w.sandbox is None


def test_run_log_and_summary_carry_the_sandbox_line(tmp_path: Path) -> None:
    # 1 prompt x 2 samples per update, one prompt in flight, one sandbox (start 1 s) at 1 USD per sandbox-second;
    # each episode: 100 tokens at 100 tokens/s (1 s); training 0.25 s; the trainer costs 3600 USD/h.
    setup = Setup(groups=[gsetup()], trainer=TrainerSetup(train_step_s=lambda n: 0.25, usd_per_hour=3600.0),
                  workload=workload(), models={}, sandbox=pool(max_live=1, start_s=1.0))
    r = simulate(plan(policies={"batcher": {"inflight_prompts": 1}}), updates=2, setup=setup, out=tmp_path / "run")
    log = RunLog.open(tmp_path / "run")
    u = log.updates
    # prompt 0: s0 holds the sandbox 0..2 (start 0..1, turn 1..2), s1 waits 0..2 and holds it 2..4; update 1 trains
    # 4..4.25 while prompt 1's first sample holds the sandbox from 4; prompt 1 the same 4..8; update 2 8..8.25.
    assert u.end_s.tolist() == pytest.approx([4.25, 8.25])
    assert u.cost_sandbox_usd.tolist() == pytest.approx([4.25, 8.25])   # one sandbox live all along
    assert u.sandbox_wait_s.tolist() == pytest.approx([2.0, 2.0])
    assert u.sandbox_s.tolist() == pytest.approx([4.0, 4.0])
    assert u.cost_trainer_usd.iloc[-1] == pytest.approx(8.25)
    t = log.trajectories.sort_values(["prompt_id", "sample_index"])
    assert t.sandbox_wait_s.tolist()[:2] == pytest.approx([0.0, 2.0])
    s = r.summary
    assert s.cost_sandbox_per_update_usd == pytest.approx(8.25 / 2)
    assert s.sandbox_wait_share == pytest.approx(4.0 / 12.0)
    assert s.cost_trainer_per_update_usd == pytest.approx(8.25 / 2)
    assert s.cost_per_update_usd == pytest.approx(s.cost_sampler_per_update_usd + 8.25 / 2 + 8.25 / 2)


def test_a_plan_without_sandboxes_logs_none(tmp_path: Path) -> None:
    setup = Setup(groups=[gsetup()], trainer=TrainerSetup(train_step_s=lambda n: 0.25, usd_per_hour=0.0),
                  workload=workload(), models={})
    r = simulate(plan(policies={"batcher": {"inflight_prompts": 1}}), updates=2, setup=setup, out=tmp_path / "run")
    u = RunLog.open(tmp_path / "run").updates
    assert u.end_s.tolist() == pytest.approx([1.25, 2.25])  # no start, no wait (the next prompt runs in training)
    assert (u.cost_sandbox_usd == 0).all() and u.sandbox_wait_s.isna().all()
    assert r.summary.cost_sandbox_per_update_usd == 0.0 and math.isnan(r.summary.sandbox_wait_share)


def test_the_sandbox_table_and_its_price() -> None:
    cat = sandbox_price()
    assert cat is not None and cat.usd_per_hour == pytest.approx((2 * 0.000014 + 4 * 0.0000045) * 3600)
    assert cat.source and cat.date
    own = resolve_sandbox(SandboxPlan(max_live=8, start_s=3.0, price_per_hour_usd=0.5, source="quote", date="2026-12"))
    assert (own.max_live, own.start_s, own.usd_per_hour) == (8, 3.0, 0.5) and "quote" in own.price_source
    by_cat = resolve_sandbox(SandboxPlan(max_live=8))
    assert by_cat.usd_per_hour == pytest.approx(cat.usd_per_hour) and "e2b" in by_cat.price_source
    assert resolve_sandbox(None) is None
    for bad in ({"max_live": 0}, {"max_live": 4, "start_s": -1.0}, {"max_live": 4, "price_per_hour_usd": -2.0}):
        with pytest.raises(SpecError):
            SandboxPlan(**bad)
    p = plan(sandbox={"max_live": 16, "start_s": 4.0})
    assert p.sandbox == SandboxPlan(max_live=16, start_s=4.0)
    assert plan_from_dict(p.to_dict()).sandbox == p.sandbox              # the table round-trips
    with pytest.raises(SpecError):
        plan(sandbox={"max_live": 16, "start": 4.0})                    # unknown key
    assert plan().sandbox is None


# ---- the planner ---------------------------------------------------------------------------------------------
TINY = {"model": "tiny", "workload": "tiny-cpu", "accelerators": ("H100", "A100-80GB"),
        "max_gpus": {"H100": 4, "A100-80GB": 2}, "trainer_accelerator": "H100", "trainer_gpus": 1, "verify": 0}


def _screen(**kw):
    from mixfleet.planner.config import PlannerConfig
    from mixfleet.planner.fleet import group_types
    from mixfleet.planner.search import screen

    cfg = PlannerConfig(**TINY, **kw)
    return cfg, screen(group_types(cfg), cfg)


def test_planner_sandboxes_that_cost_nothing_and_start_at_once_change_nothing() -> None:
    _, (n0, k0, m0) = _screen()
    _, (n1, k1, m1) = _screen(sandboxes=True, sandbox_start_s=0.0, sandbox_usd_per_hour=0.0)
    assert (n0 == n1).all() and (k0 == k1).all()
    for key in ("time_per_update_s", "cost_per_update", "staleness", "throughput"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-12)
    # without sandboxes nothing waits for one: cost 0 and wait share 0 (a number, so equal checks compare equal)
    assert (m0["cost_sandbox_per_update"] == 0).all() and (m0["sandbox_wait_share"] == 0).all()
    assert (m1["sandbox_wait_share"] == 0).all() and (m1["sandboxes_live"] > 0).all()


def test_planner_charges_every_episode_its_sandbox_time_and_splits_the_cost() -> None:
    cfg, (n, k, m) = _screen(sandbox_start_s=1.0, sandbox_usd_per_hour=0.36)
    assert cfg.sandboxes and cfg.sandbox_cap is None
    assert (m["sandbox_wait_share"] == 0).all()                         # sized with the fleet: no one waits
    split = m["cost_sampling_per_update"] + m["cost_training_per_update"] + m["cost_sandbox_per_update"]
    assert m["cost_per_update"] == pytest.approx(split, rel=1e-9)
    # each of the update's 16 x 8 episodes holds its sandbox at least its 1 s start: >= 128 sandbox-seconds
    assert (m["cost_sandbox_per_update"] >= 128 * 1.0 * 0.36 / 3600 * (1 - 1e-9)).all()
    # Little's law: mean live sandboxes = sandbox-seconds per update / time per update
    assert m["sandboxes_live"] == pytest.approx(m["cost_sandbox_per_update"] * 3600 / 0.36 / m["time_per_update_s"])


def test_the_budget_covers_the_sandboxes_when_they_are_planned() -> None:
    _, (n0, _, m0) = _screen()
    cfg, (n1, _, m1) = _screen(sandbox_start_s=1.0, sandbox_usd_per_hour=0.36)
    assert (n0 == n1).all()
    # USD/h = fleet + trainer + live sandboxes x their price (Little's law), so that x time per update = the cost
    assert m1["usd_per_hour"] == pytest.approx(m0["usd_per_hour"] + m1["sandboxes_live"] * 0.36, rel=1e-12)
    assert m1["usd_per_hour"] * m1["time_per_update_s"] / 3600 == pytest.approx(m1["cost_per_update"], rel=1e-9)
    # a budget between the two burn rates of the cheapest-per-hour mix keeps it without sandboxes, not with them
    i = int(m0["usd_per_hour"].argmin())
    budget = (m0["usd_per_hour"][i] + m1["usd_per_hour"][i]) / 2
    from mixfleet.planner.fleet import feasible

    assert feasible({k: v[i:i + 1] for k, v in m0.items()}, _screen(max_usd_per_hour=budget)[0])[0]
    assert not feasible({k: v[i:i + 1] for k, v in m1.items()},
                        _screen(max_usd_per_hour=budget, sandbox_start_s=1.0, sandbox_usd_per_hour=0.36)[0])[0]


def test_planner_cap_that_binds_queues_episodes_and_keeps_the_cap_live() -> None:
    cfg, (n, k, m) = _screen(sandbox_cap=32, sandbox_start_s=1.0, sandbox_usd_per_hour=0.36)
    binds = m["sandbox_wait_share"] > 0
    assert binds.all()                                  # 16..128 prompts x 8 samples in flight: all above 32
    sampler_bound = ~m["trainer_bound"]
    assert sampler_bound.any()
    # at the cap every sandbox is held all the time: Little's law gives exactly the cap live on average
    assert m["sandboxes_live"][sampler_bound] == pytest.approx(32.0, rel=1e-3)


def test_plan_says_when_the_sandbox_cap_binds_and_what_relaxing_it_buys() -> None:
    from mixfleet.planner.config import PlannerConfig
    from mixfleet.planner.search import plan_mix

    sb = {"sandbox_start_s": 1.0, "sandbox_usd_per_hour": 0.36}
    free = plan_mix(PlannerConfig(**TINY, **sb))
    capped = plan_mix(PlannerConfig(**TINY, **sb, sandbox_cap=32))
    b = next(b for b in capped.binds if b.flag == "--sandbox-cap")
    assert b.relaxed_objective == pytest.approx(free.best.cost_per_update_usd)    # relaxed: the uncapped best
    assert b.gain > 0 and b.relaxed_value == pytest.approx(free.best.sandboxes_live)
    assert "--sandbox-cap 32 binds" in b.text() and "sandboxes live on average" in b.text()
    assert capped.best.sandbox_wait_share > 0 and free.best.sandbox_wait_share == 0
    assert capped.plan.sandbox == SandboxPlan(max_live=32, start_s=1.0, price_per_hour_usd=0.36,
                                              source=capped.plan.sandbox.source)
    assert free.plan.sandbox.max_live == free.best.inflight_prompts * 8          # sized: every episode in flight
    loose = plan_mix(PlannerConfig(**TINY, **sb, sandbox_cap=1_000_000))
    assert not [x for x in loose.binds if x.flag == "--sandbox-cap"] and loose.best.sandbox_wait_share == 0
    assert plan_mix(PlannerConfig(**TINY)).plan.sandbox is None                   # no sandboxes: no table


def test_planner_sandbox_settings_are_checked() -> None:
    from mixfleet.planner.config import PlannerConfig

    for bad in ({"sandbox_cap": 0}, {"sandbox_start_s": -1.0}, {"sandbox_usd_per_hour": -0.1},
                {"sandbox_cap": True}):
        with pytest.raises(SpecError):
            PlannerConfig(**TINY, **bad)
    assert PlannerConfig(**TINY, sandbox_usd_per_hour=0.2).sandboxes
    assert PlannerConfig(**TINY, sandboxes=True).sandbox_price() == pytest.approx(sandbox_price().usd_per_hour)


def test_the_planners_figures_for_a_plan_carry_its_sandboxes() -> None:
    from mixfleet.planner.search import evaluate_plan
    from mixfleet.policies.plan import load_plan, with_overrides

    p = load_plan("tiny-cpu")
    with_sb = plan_from_dict({**p.to_dict(), "sandbox": {"max_live": 4, "start_s": 1.0, "price_per_hour_usd": 0.36}})
    a, b = evaluate_plan(p), evaluate_plan(with_sb)
    assert a.cost_sandbox_per_update_usd == 0 and b.cost_sandbox_per_update_usd > 0
    assert b.sandbox_wait_share > 0 and b.sandboxes_live == pytest.approx(4.0, rel=1e-3)   # the cap binds
    assert with_overrides(with_sb, {}).sandbox == with_sb.sandbox


def test_the_dry_run_page_splits_the_cost_only_for_a_run_with_sandboxes() -> None:
    from mixfleet.ui.app_dryrun import cost_split_note

    assert cost_split_note({"cost_sandbox_per_update_usd": 0.0, "sandbox_wait_share": float("nan")}) is None
    line = cost_split_note({"cost_sampler_per_update_usd": 58.26, "cost_trainer_per_update_usd": 16.07,
                            "cost_sandbox_per_update_usd": 27.25, "sandbox_wait_share": 0.631})
    assert "sampling $58.26" in line and "training $16.07" in line and "sandboxes $27.25" in line
    assert "63.1 %" in line


def test_the_re_planner_prices_the_plans_sandboxes() -> None:
    from mixfleet.planner.solver import planner_config, planner_solver
    from mixfleet.policies.plan import load_plan, with_overrides
    from mixfleet.policies.registry import make_config

    over: dict[str, object] = {"policies.autoscaler.name": "replan"}
    for g in load_plan("tiny-cpu").groups:
        over.update({f"groups.{g.name}.min_replicas": 1, f"groups.{g.name}.max_replicas": 4,
                     f"groups.{g.name}.replicas": 2})
    plain = with_overrides(load_plan("tiny-cpu"), over)
    boxed = plan_from_dict({**plain.to_dict(), "sandbox": {"max_live": 8, "start_s": 1.0, "price_per_hour_usd": 36}})
    cfg = make_config("autoscaler", "replan", {})
    assert not planner_config(plain, cfg).sandboxes
    c = planner_config(boxed, cfg)
    assert (c.sandboxes, c.sandbox_cap, c.sandbox_start_s, c.sandbox_usd_per_hour) == (True, 8, 1.0, 36.0)
    counts = {g.name: 2 for g in plain.groups}
    names = tuple(counts)
    a = planner_solver(plain, cfg)(None, counts, names, {})
    b = planner_solver(boxed, cfg)(None, counts, names, {})
    assert b.objective_now > a.objective_now and b.feasible      # the same counts now pay their sandboxes
