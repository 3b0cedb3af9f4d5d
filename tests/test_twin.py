"""The twin: exact timelines computed by hand, processor sharing against its closed form, staleness, routing
shares, fault injection. Small scenarios with hand-computable replica rates (FixedRates), CPU, seeded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import simpy
from mixfleet.costmodel.records.runlog import RunLog, RunLogWriter
from mixfleet.costmodel.specs.workload import workload_from_dict
from mixfleet.policies.plan import plan_from_dict
from mixfleet.policies.prompt_buffer import PromptGroup
from mixfleet.twin.core import Replica, Request
from mixfleet.twin.episodes import Episode
from mixfleet.twin.rates import FixedRates, Setup
from mixfleet.twin.sim import simulate
from mixfleet.twin.world import GroupSetup, Session, TrainerSetup, World


def workload(**kw):
    raw = {"name": "w", "prompts_per_update": 1, "samples_per_prompt": 2, "max_context": 1_000_000, "turns": 1,
           "prompt_tokens": 10, "reply_tokens": 100, "tool_output_tokens": 0, "tool_latency_s": 0.0,
           "success_prob": 1.0}
    return workload_from_dict({**raw, **kw})


def gsetup(name: str = "g", rates: FixedRates | None = None, replicas: int = 1, cap: float = 100.0,
           sync_s: float = 0.0, **kw) -> GroupSetup:
    return GroupSetup(name=name, rates=rates or FixedRates(), replicas=replicas, min_replicas=replicas,
                      max_replicas=replicas, capacity_tokens_per_s=cap, usd_per_mtoken=1.0, weight_sync_s=sync_s, **kw)


def plan(groups: list[str], **kw) -> object:
    raw = {"name": "t", "model": "tiny", "workload": "tiny-cpu",
           "groups": [{"name": g, "accelerator": "H100", "precision": "bf16"} for g in groups], **kw}
    return plan_from_dict(raw)


def world(tmp_path: Path, groups: list[GroupSetup]) -> World:
    p = plan([g.name for g in groups])
    w = World(groups=groups, trainer=TrainerSetup(train_step_s=lambda n: 1.0, usd_per_hour=0.0), workload=workload(),
              policies=p.build_policies(), seed=0, writer=RunLogWriter(tmp_path / "log", {"source": "twin"}),
              run_id="t")
    w.admit_prompts = lambda: None  # only the sessions a test injects run
    return w


def inject(w: World, sid: int, ep: Episode, at_s: float) -> Session:
    """Start one session of its own prompt-group at `at_s` (bypassing the batcher's admission)."""
    s = Session(sid=sid, prompt_id=sid, sample=0, ep=ep)
    w.prompts.inflight[sid] = PromptGroup(prompt_id=sid, expected=1)
    w.env.timeout(at_s).callbacks.append(lambda _e: w._begin(s))
    return s


def ep(replies: list[int], prompt: int = 0, tools: list[int] | None = None, tool_s: list[float] | None = None):
    n = len(replies)
    return Episode(turns=n, prompt_tokens=prompt, reply_tokens=tuple(replies),
                   tool_tokens=tuple(tools or [0] * (n - 1)), tool_s=tuple(tool_s or [0.0] * (n - 1)), reward=1.0,
                   finish_reason="done")


def test_two_sessions_share_one_replica_exactly(tmp_path: Path) -> None:
    # step(n) = 0.01 + 0.01 n seconds: alone 50 tokens/s, two at once 33.3 tokens/s each.
    w = world(tmp_path, [gsetup(rates=FixedRates(step_s=0.01, per_seq_s=0.01))])
    a = inject(w, 0, ep([100]), at_s=0.0)
    b = inject(w, 1, ep([30]), at_s=1.0)
    w.env.run(until=10)
    # a: 50 tokens by t=1; then both at 33.3/s: b's 30 take 0.9 s (t=1.9), a has 20 left, alone: 0.4 s -> 2.3
    assert b.end_s == pytest.approx(1.9, abs=1e-9)
    assert a.end_s == pytest.approx(2.3, abs=1e-9)
    assert w.groups["g"].replicas[0].tokens_generated == 130


def test_multi_turn_prefills_only_new_tokens_on_the_sticky_replica(tmp_path: Path) -> None:
    # decode 100 tokens/s at any batch; prefill 1 ms per token, serial (stalls decoding).
    w = world(tmp_path, [gsetup(rates=FixedRates(step_s=0.01, prefill_per_token_s=0.001))])
    s = inject(w, 0, ep([50, 20], prompt=100, tools=[30], tool_s=[2.0]), at_s=0.0)
    w.env.run(until=10)
    # prefill 100 (0.1) + decode 50 (0.5) = 0.6; tool 2.0 -> 2.6; prefill 30 new (0.03) + decode 20 (0.2) = 2.83
    assert s.end_s == pytest.approx(2.83, abs=1e-9)
    assert s.context == 100 + 50 + 30 + 20 and s.prompt_total == 130


def test_kv_capacity_makes_the_second_request_wait(tmp_path: Path) -> None:
    # each request reserves context 10 + reply 100 = 110 KV tokens; capacity 150 holds one
    w = world(tmp_path, [gsetup(rates=FixedRates(step_s=0.01, kv_capacity_tokens=150))])
    a = inject(w, 0, ep([100], prompt=10), at_s=0.0)
    b = inject(w, 1, ep([100], prompt=10), at_s=0.0)
    w.env.run(until=10)
    assert (a.end_s, b.end_s) == pytest.approx((1.0, 2.0), abs=1e-9)


def test_processor_sharing_matches_the_m_g_1_ps_closed_form() -> None:
    """Poisson arrivals into one replica with total rate mu tokens/s shared equally (step(n) = n / mu):
    mean response time = E[S] / (1 - rho) whatever the size distribution (M/G/1-PS)."""
    mu, lam, mean_tokens, n_jobs = 100.0, 0.5, 100.0, 20_000
    rep = Replica("g", 0, FixedRates(step_s=0.0, per_seq_s=1.0 / mu))
    env, rng = simpy.Environment(), np.random.default_rng(1)
    done: list[float] = []
    gen = [0]

    def poke() -> None:  # the world's scheme: one pending wake-up per replica, older ones ignored
        gen[0] += 1
        t, g = rep.next_event_s(), gen[0]
        if t is not None:
            env.timeout(t - env.now).callbacks.append(lambda _e: wake(g))

    def wake(g: int) -> None:
        if g == gen[0]:
            rep.advance_to(env.now)
            done.extend(env.now - req.tag for req in rep.complete_due(env.now))
            poke()

    def arrivals():
        for _ in range(n_jobs):
            yield env.timeout(rng.exponential(1 / lam))
            size = max(1, round(rng.exponential(mean_tokens)))
            rep.advance_to(env.now)
            rep.submit(Request(tag=env.now, new_tokens=0, reply_tokens=size, context_tokens=0),
                       env.now)
            poke()

    env.process(arrivals())
    env.run()
    es = (mean_tokens + 0.5) / mu                      # sizes are rounded exponentials (mean ~100.5 tokens)
    expected = es / (1 - lam * es)
    assert len(done) == n_jobs
    assert np.mean(done) == pytest.approx(expected, rel=0.06)
    # and n equal jobs arriving together all finish at n * size / mu
    rep2 = Replica("g", 0, FixedRates(step_s=0.0, per_seq_s=1.0 / mu))
    for _ in range(4):
        rep2.submit(Request(new_tokens=0, reply_tokens=50, context_tokens=0), 0.0)
    assert rep2.next_event_s() == pytest.approx(4 * 50 / mu)


def sim(tmp_path: Path, groups: list[GroupSetup], wl, updates: int, train_s: float = 0.25, **plan_kw):
    p = plan([g.name for g in groups], **plan_kw)
    setup = Setup(groups=groups, trainer=TrainerSetup(train_step_s=lambda n: train_s, usd_per_hour=3600.0),
                  workload=wl, models={})
    return simulate(p, updates=updates, setup=setup, out=tmp_path / "run")


def test_update_timeline_staleness_and_costs_by_hand(tmp_path: Path) -> None:
    # 2 prompts x 2 samples in flight, 1 turn of 100 tokens at 100 tokens/s (any batch): every
    # trajectory takes 1 s. Update = 1 prompt-group; training 1 s; weight push 0.5 s (in flight).
    g = gsetup(rates=FixedRates(step_s=0.01, price_usd_per_hour=1.0), sync_s=0.5)
    r = sim(tmp_path, [g], workload(prompts_per_update=2), updates=3, train_s=1.0,
            policies={"batcher": {"inflight_prompts": 2}})
    u = RunLog.open(tmp_path / "run").updates
    # t=1: prompts 0,1 done, 2,3 start; update 1 trains [1, 2], pushes [2, 2.5]; update 2 [2.5, 4] on prompts
    # 2,3 (done at t=2, sampled on v0: staleness 1); prompts 4,5 run [2, 3]: 50 tokens on v0, 50 on v1
    # (v1 lands at 2.5), trained in update 3 [4, 5.5] from version 2: staleness (2-0 + 2-1) / 2 = 1.5
    assert u.start_s.tolist() == [1.0, 2.5, 4.0] and u.end_s.tolist() == [2.5, 4.0, 5.5]
    assert u.staleness_mean.tolist() == [0.0, 1.0, 1.5]
    assert u.staleness_max.tolist() == [0.0, 1.0, 2.0]
    assert u.cost_sampler_usd.iloc[-1] == pytest.approx(5.5 / 3600)       # one replica at 1 USD/h for 5.5 s
    assert u.cost_trainer_usd.iloc[-1] == pytest.approx(5.5)              # 3600 USD/h
    assert r.summary.trainer_idle_share == pytest.approx(1 - 3 * 1.5 / 5.5)


def test_staleness_on_a_deterministic_workload_is_the_hand_count(tmp_path: Path) -> None:
    """K one-prompt updates in flight; every trajectory is 1,000 tokens at 1,000 tokens/s; training takes
    10 ms. Each 1-s cycle, K prompts start on version V while the previous K are trained: their first
    10 tokens are sampled on V, the next 10 on V+1, ..., the rest on V+K; they are trained from versions
    V+K .. V+2K-1. Mean staleness per cycle: (K-1)/2 + 10 * K(K+1)/2 / 1000."""
    for k in (4, 8):
        g = gsetup(rates=FixedRates(step_s=0.001))
        wl = workload(reply_tokens=1000, samples_per_prompt=1)
        r = sim(tmp_path / str(k), [g], wl, updates=12 * k, train_s=0.01,
                policies={"batcher": {"inflight_prompts": k}})
        u = RunLog.open(tmp_path / str(k) / "run").updates
        steady = u.staleness_mean.to_numpy()[4 * k:]
        assert steady.mean() == pytest.approx((k - 1) / 2 + 0.005 * k * (k + 1), abs=1e-9)
        assert sorted(set(np.round(steady - 0.005 * k * (k + 1), 9))) == list(range(k))
        assert r.summary.time_per_update_mean_s == pytest.approx(1.0 / k, rel=0.05)


def test_staleness_follows_littles_law(tmp_path: Path) -> None:
    """Little's law: versions arrive at rate lambda (updates/s), so a token waiting W seconds between being
    sampled and trained is lambda * W versions stale on average. One-turn trajectories decode at a constant
    rate, so a trajectory's tokens are sampled on average at the middle of [start, end]."""
    g = gsetup(rates=FixedRates(step_s=0.01), replicas=1)
    wl = workload(reply_tokens={"kind": "uniform", "low": 50, "high": 350, "integer": True}, samples_per_prompt=2,
                  prompts_per_update=2)
    sim(tmp_path, [g], wl, updates=300, train_s=0.3, policies={"batcher": {"inflight_prompts": 12}})
    log = RunLog.open(tmp_path / "run")
    u, t = log.updates.set_index("version"), log.trajectories
    t = t[t.trained_version > 50]
    lam = (len(u) - 50) / (u.end_s.iloc[-1] - u.end_s.loc[50])
    wait_s = u.start_s.loc[t.trained_version].to_numpy() - (t.start_s + t.end_s).to_numpy() / 2
    w = t.generated_tokens.to_numpy()
    measured = float((u.staleness_mean.loc[51:] * u.tokens.loc[51:]).sum() / u.tokens.loc[51:].sum())
    assert measured == pytest.approx(lam * float((wait_s * w).sum() / w.sum()), rel=0.08)


def test_capacity_proportional_shares_match_capacity_over_a_long_run(tmp_path: Path) -> None:
    groups = [gsetup("fast", FixedRates(step_s=0.005), replicas=2, cap=200.0),
              gsetup("mid", FixedRates(step_s=0.01), replicas=1, cap=100.0),
              gsetup("slow", FixedRates(step_s=0.02), replicas=3, cap=50.0)]
    wl = workload(turns={"kind": "uniform", "low": 1, "high": 4, "integer": True},
                  reply_tokens={"kind": "uniform", "low": 20, "high": 200, "integer": True},
                  samples_per_prompt=4, prompts_per_update=4, tool_latency_s=0.5)
    r = sim(tmp_path, groups, wl, updates=60, train_s=0.05)
    caps = {"fast": 400.0, "mid": 100.0, "slow": 150.0}
    for name, c in caps.items():
        assert abs(r.summary.group_share_of_samples[name] - c / 650.0) <= 0.02


@pytest.mark.parametrize(("on_loss", "weight_sync"), [("resume", "in_flight"), ("restart", "drain")])
def test_fault_injection_loses_no_trajectory(tmp_path: Path, on_loss: str, weight_sync: str) -> None:
    groups = [gsetup("a", FixedRates(step_s=0.01, cold_start_s=2.0), replicas=2, sync_s=0.3),
              gsetup("b", FixedRates(step_s=0.02, cold_start_s=2.0), replicas=2, cap=50.0, sync_s=0.3)]
    wl = workload(turns={"kind": "uniform", "low": 2, "high": 6, "integer": True}, samples_per_prompt=4,
                  prompts_per_update=2, tool_latency_s=0.3)
    r = sim(tmp_path, groups, wl, updates=15, train_s=0.5,
            faults={"preemptions_per_replica_hour": 600.0, "on_loss": on_loss},
            policies={"autoscaler": {"name": "fixed", "interval_s": 1.0}, "weight_sync": {"name": weight_sync}})
    log = RunLog.open(tmp_path / "run")
    t, ev = log.trajectories, log.events
    assert r.turns_lost > 0 and (ev.kind == "preempt").sum() > 0 and (ev.kind == "ready").sum() > 0
    assert r.trajectories_in_flight >= 0
    assert r.sessions_started == len(t) + r.trajectories_buffered + r.trajectories_in_flight
    assert len(t) == 15 * 8 and t.restarts.sum() > 0
    assert (t.generated_tokens > 0).all() and set(t.finish_reason) == {"done"}
    if on_loss == "restart":
        assert r.sessions_restarted > 0


def test_the_same_seed_gives_the_same_run(tmp_path: Path) -> None:
    groups = [gsetup("a", FixedRates(step_s=0.01)), gsetup("b", FixedRates(step_s=0.02), cap=50.0)]
    wl = workload(turns={"kind": "uniform", "low": 1, "high": 5, "integer": True},
                  reply_tokens={"kind": "lognormal", "median": 50, "sigma": 0.5, "integer": True, "min": 1},
                  samples_per_prompt=4, prompts_per_update=2, tool_latency_s={"kind": "uniform", "low": 0, "high": 1})
    a = sim(tmp_path / "a", groups, wl, updates=5, faults={"preemptions_per_replica_hour": 300.0})
    b = sim(tmp_path / "b", groups, wl, updates=5, faults={"preemptions_per_replica_hour": 300.0})
    ta, tb = (RunLog.open(tmp_path / x / "run").trajectories.drop(columns=["run_id"]) for x in "ab")
    assert ta.equals(tb) and a.simulated_s == b.simulated_s and a.events == b.events


def test_drain_never_mixes_versions_within_a_request_and_in_flight_does(tmp_path: Path) -> None:
    wl = workload(reply_tokens={"kind": "uniform", "low": 50, "high": 300, "integer": True}, samples_per_prompt=2,
                  prompts_per_update=2)
    mixed = {}
    for ws in ("drain", "in_flight"):
        g = gsetup(rates=FixedRates(step_s=0.01), sync_s=0.2)
        sim(tmp_path / ws, [g], wl, updates=10, train_s=0.3,
            policies={"weight_sync": {"name": ws}, "batcher": {"inflight_prompts": 6}})
        t = RunLog.open(tmp_path / ws / "run").trajectories
        mixed[ws] = int((t.version_start != t.version_end).sum())   # one-turn trajectories: one request each
    assert mixed["drain"] == 0 and mixed["in_flight"] > 0


def test_queue_based_autoscaling_pays_cold_starts(tmp_path: Path) -> None:
    g = GroupSetup(name="g", rates=FixedRates(step_s=0.01, per_seq_s=0.002, cold_start_s=5.0, price_usd_per_hour=3600),
                   replicas=1, min_replicas=1, max_replicas=4, capacity_tokens_per_s=100.0, usd_per_mtoken=1.0,
                   weight_sync_s=0.0)
    wl = workload(samples_per_prompt=8, prompts_per_update=4, turns=3, tool_latency_s=0.1)
    sim(tmp_path, [g], wl, updates=6, train_s=0.1,
        policies={"autoscaler": {"name": "queue_based", "interval_s": 2.0, "target_backlog_s": 1.0,
                                 "idle_timeout_s": 1000.0}})
    # (the world takes min/max replicas from the GroupSetup: 1..4)
    log = RunLog.open(tmp_path / "run")
    ev, u = log.events, log.updates
    ups = ev[ev.kind == "ready"]
    assert 1 <= len(ups) <= 3 and (ev[ev.kind == "cold_start"].duration_s == 5.0).all()
    starts = ev[ev.kind == "cold_start"].time_s.to_numpy()
    end = u.end_s.iloc[-1]
    # 1 USD per replica-second: the first replica all along, each started one from its cold start on
    assert u.cost_sampler_usd.iloc[-1] == pytest.approx(end + (end - starts).sum(), rel=1e-9)


def test_a_batcher_that_never_forms_an_update_is_an_error_not_a_hang(tmp_path: Path) -> None:
    from mixfleet.costmodel.errors import SpecError
    from mixfleet.policies.batcher import BatchDecision, Batcher
    from mixfleet.policies.registry import register

    @register("batcher", "_test_never")
    class Never(Batcher):
        def decide(self, buffer):
            return BatchDecision()

    g = gsetup(rates=FixedRates(step_s=0.01))
    with pytest.raises(SpecError, match="updates form"):
        sim(tmp_path, [g], workload(), updates=2, policies={"batcher": {"name": "_test_never"},
                                                            "autoscaler": {"name": "fixed", "interval_s": 5.0}})
