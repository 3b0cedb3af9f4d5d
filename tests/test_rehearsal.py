"""A plan's rehearsal on this machine (runner/orchestration/rehearsal.py, issue 26 Broken 4): `mixfleet run
seed-mixed --embedded` exited 2 ("35.4B parameters on CPU"); now it runs the plan's own fleet (every group's
precision, KV dtype, kernel; the policies) with the tiny stand-in of the plan's model family, replica counts
scaled to the machine and said in the output. What still cannot run here is refused, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.policies.plan import load_plan
from mixfleet.runner.orchestration.rehearsal import (
    REHEARSAL_BATCH,
    SAMPLER_MEMORY_BYTES,
    Machine,
    rehearsal_of,
)

TWO_CORES = Machine(cores=2, memory_bytes=16 << 30)


def test_seed_mixed_is_rehearsed_with_its_own_groups_on_the_moe_stand_in() -> None:
    seed = load_plan("seed-mixed")
    r = rehearsal_of(seed, TWO_CORES)
    p = r.plan
    assert (p.model, p.workload) == ("tiny-qwen3-moe", "tiny-cpu")
    # every group as planned: name, accelerator, precision, KV dtype, kernel; one embedded sampler each here
    assert [(g.name, g.accelerator, g.precision, g.kv_dtype, g.kernel) for g in p.groups] == \
           [(g.name, g.accelerator, g.precision, g.kv_dtype, g.kernel) for g in seed.groups]
    assert [g.replicas for g in p.groups] == [g.replicas for g in seed.groups]      # fleet.py scales them
    assert [(g.planned, g.here) for g in r.groups] == [(g.replicas, 1) for g in seed.groups]
    assert all(g.tp == 0 and g.dp_attention == 1 and g.ep == 1 for g in p.groups)
    assert p.embedded is not None and p.embedded.max_replicas_per_group == 1        # 2 cores over 8 groups
    # the trainer and the policies are the plan's; only the batch is cut to tiny-cpu's
    assert p.trainer == seed.trainer and p.prices == seed.prices and p.price_table == seed.price_table
    for kind in ("router", "autoscaler", "weight_sync"):
        assert getattr(p.policies, kind) == getattr(seed.policies, kind)
    assert p.policies.batcher.name == seed.policies.batcher.name
    assert {k: p.policies.batcher.settings[k] for k in REHEARSAL_BATCH} == REHEARSAL_BATCH
    text = "\n".join(r.lines())
    assert "qwen3.6-35b-a3b (35.4B parameters, moe) -> its tiny stand-in tiny-qwen3-moe" in text
    assert "54 replicas -> 8 embedded samplers (at most 1 per group: this machine's 2 cores over 8 groups)" in text
    assert "batch 128 x 8 (512 in flight) -> 8 x 8 (12 in flight)" in text
    assert "RTX-PRO-6000-BF16: bf16 weights, KV fp8_e4m3: 15 planned RTX-PRO-6000 replicas" in text


def test_replicas_follow_the_machine_and_a_dense_plan_gets_the_dense_stand_in() -> None:
    homo = load_plan("seed-homogeneous")                            # one group of 65 B200 replicas
    r = rehearsal_of(homo, Machine(cores=16, memory_bytes=64 << 30))
    assert [g.here for g in r.groups] == [16]
    from mixfleet.policies.plan import with_overrides

    dense = with_overrides(homo, {"model": "llama-3.1-8b"})
    assert rehearsal_of(dense, TWO_CORES).plan.model == "tiny"


def test_a_cpu_plan_of_a_cpu_sized_model_runs_as_written() -> None:
    for name in ("tiny-cpu", "tiny-moe-cpu"):
        plan = load_plan(name)
        r = rehearsal_of(plan, TWO_CORES)
        assert r.plan is plan and r.changes == ()
        assert r.lines() == [f"rehearsal of '{name}' as written (3 embedded samplers)"]


def test_more_samplers_than_this_machine_holds_is_refused_naming_why() -> None:
    small = Machine(cores=2, memory_bytes=6 * SAMPLER_MEMORY_BYTES)   # 4 samplers beside the trainer and Ray
    with pytest.raises(SpecError) as e:
        rehearsal_of(load_plan("seed-mixed"), small)
    msg = str(e.value)
    assert "plan 'seed-mixed'" in msg and "'groups' = '8 embedded samplers'" in msg
    assert "at most 4 on this machine" in msg and "Ray cluster" in msg


@pytest.mark.slow
def test_seed_mixed_rehearsed_with_embedded_for_two_updates(tmp_path: Path) -> None:
    """A real run (Ray, the Megatron-core trainer on the tiny Qwen3-MoE, 8 embedded samplers in the seed's
    precisions): seed-mixed with a test-sized batch, `--embedded`, 2 updates, held-out evaluations at 0 and 2
    (about 80 s alone on 2 cores)."""
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    init = init_model(load_model_spec("tiny-qwen3-moe"), tmp_path / "init", seed=0)
    plan = tmp_path / "seed-mixed-short.toml"
    plan.write_text('base = "seed-mixed"\nname = "seed-mixed-short"\n\n[policies.batcher]\nprompts_per_update = 2\n'
                    'samples_per_prompt = 2\ninflight_prompts = 4\n\n[embedded]\nmax_turns = 2\nmax_new_tokens = 8\n'
                    'eval_every = 2\npass_k = 2\n\n[embedded.extra]\neval_problems = 2\n')
    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["run", str(plan), "--embedded", "--out", str(out), "--init", str(init),
                                 "--updates", "2", "--quiet"])
    assert r.exit_code == 0, r.output[-3000:]
    assert "-> its tiny stand-in tiny-qwen3-moe" in r.output
    assert "54 replicas -> 8 embedded samplers" in r.output
    log = RunLog.open(out)
    assert log.header["status"] == "finished" and log.source == "runner"
    assert log.header["plan"]["model"] == "tiny-qwen3-moe"
    seed = load_plan("seed-mixed")
    assert [(g["name"], g["precision"], g["kv_dtype"]) for g in log.header["plan"]["groups"]] == \
           [(g.name, g.precision, g.kv_dtype) for g in seed.groups]
    assert len(log.updates) == 2
    assert set(log.groups["group"]) <= {g.name for g in seed.groups}
    ready = log.events[log.events["kind"] == "ready"]
    assert set(ready["group"]) == {g.name for g in seed.groups}          # every group's sampler started
    # the held-out evaluations record how they sampled (the Runs page states it under the held-out chart)
    from mixfleet.ui.app_charts import heldout_frame

    ev = heldout_frame(log.events)
    assert ev["version"].tolist() == [0, 2]
    assert ev[["k", "problems", "task", "max_new_tokens", "max_turns"]].iloc[-1].tolist() == [2, 2, "guess", 8, 2]
    assert ev["temperature"].tolist() == [1.0, 1.0]
