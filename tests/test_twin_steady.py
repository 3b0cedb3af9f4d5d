"""The twin's steady state: a warm start (sessions and prompt-groups seeded at the ages the workload implies)
measures the same steady state as a cold start from empty pipelines, within their 95% intervals, with a
shorter pipeline fill; and the analytic screen's figures for a seed fleet lie near the twin's (slow)."""

from __future__ import annotations

from pathlib import Path

from mixfleet.costmodel.specs.workload import workload_from_dict
from mixfleet.policies.plan import plan_from_dict
from mixfleet.twin.rates import FixedRates, Setup
from mixfleet.twin.sim import simulate
from mixfleet.twin.world import GroupSetup, TrainerSetup

STEADY = (("steady_time_per_update_s", "steady_time_per_update_ci_s"),
          ("steady_cost_per_update_usd", "steady_cost_per_update_ci_usd"),
          ("steady_staleness_mean", "steady_staleness_ci"))


def _run(tmp_path: Path, updates: int, warm: bool):
    """Sampler-bound: 2 KV-limited replicas, multi-turn lognormal episodes with tool calls, 4 x 4 per update,
    16 prompts in flight (K / B = 4 updates of lifetime), a trainer 10x faster than the samplers."""
    wl = workload_from_dict({
        "name": "w", "prompts_per_update": 4, "samples_per_prompt": 4, "max_context": 1_000_000,
        "turns": {"kind": "lognormal", "median": 6, "sigma": 0.6, "min": 1, "max": 40, "integer": True},
        "prompt_tokens": 50, "reply_tokens": {"kind": "lognormal", "median": 40, "sigma": 0.5, "min": 1},
        "tool_output_tokens": 20, "tool_latency_s": {"kind": "lognormal", "median": 0.5, "sigma": 0.8},
        "success_prob": 0.5})
    rates = FixedRates(step_s=0.01, per_seq_s=0.001, kv_capacity_tokens=4_000, price_usd_per_hour=2.0)
    groups = [GroupSetup(name=f"g{i}", rates=rates, replicas=1, min_replicas=1, max_replicas=1,
                         capacity_tokens_per_s=100.0, usd_per_mtoken=1.0, weight_sync_s=0.1) for i in range(2)]
    plan = plan_from_dict({"name": "t", "model": "tiny", "workload": "tiny-cpu",
                           "groups": [{"name": g.name, "accelerator": "H100", "precision": "bf16"} for g in groups],
                           "policies": {"batcher": {"inflight_prompts": 16}}})
    setup = Setup(groups=groups, trainer=TrainerSetup(train_step_s=lambda n: 0.5, usd_per_hour=3600.0),
                  workload=wl, models={})
    return simulate(plan, updates=updates, setup=setup, out=tmp_path / ("warm" if warm else "cold"),
                    warm_start=warm, seed=3)


def test_warm_and_cold_starts_agree_on_the_steady_state(tmp_path: Path) -> None:
    cold = _run(tmp_path, 80, warm=False).summary
    warm = _run(tmp_path, 30, warm=True).summary
    assert cold.trainer_idle_share > 0.5  # sampler-bound: the steady state is the samplers'
    for mean, ci in STEADY:
        a, b = getattr(cold, mean), getattr(warm, mean)
        assert abs(a - b) <= getattr(cold, ci) + getattr(warm, ci), (mean, a, b)
        assert 0 < getattr(warm, ci) < 0.2 * abs(b)
    assert warm.first_update_s < 0.6 * cold.first_update_s  # the warm start skips most of the pipeline fill
    assert warm.steady_updates >= 15
