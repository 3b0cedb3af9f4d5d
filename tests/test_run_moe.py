"""A test-sized real run on the tiny Qwen3-MoE with routing replay: Ray actors, two embedded MoE sampler groups
(bf16 with an fp32 kernel, nvfp4 + fp8 KV) that record every token's experts, the Megatron-core MoE trainer
replaying them. Checked in the run log: both updates trained, and each group's routing disagreement (the
samplers' experts vs the trainer's own router) recorded as a share in [0, 1] with the layer share never
above the token share (a token differing in k of L layers counts 1 in one, k / L in the other).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.policies.plan import load_plan
from mixfleet.runner.orchestration.orchestrator import RunConfig, run_plan
from runplans import CPU_BF16, CPU_NVFP4, run_files, run_plan_toml

PLAN = run_plan_toml(
    "test-run-moe", [CPU_BF16, CPU_NVFP4], model="tiny-qwen3-moe", trainer={"loss": "sc_mis", "routing": "replay"},
    batcher={"prompts_per_update": 2, "samples_per_prompt": 2, "inflight_prompts": 4},
    embedded={"max_turns": 2, "max_new_tokens": 10})


@pytest.mark.slow
def test_moe_run_with_routing_replay_logs_routing_disagreement(tmp_path: Path) -> None:
    init, plan_path = run_files(tmp_path, PLAN, model="tiny-qwen3-moe")
    out = tmp_path / "out"
    res = run_plan(load_plan(plan_path), RunConfig(out_dir=out, updates=2, init_checkpoint=str(init),
                                                   ray_num_cpus=2))
    assert res["version"] == 2
    log = RunLog.open(out)
    assert (log.header.get("plan") or {}).get("trainer", {}).get("routing") == "replay"
    g = log.groups
    assert sorted(g["version"].unique().tolist()) == [1, 2]
    trained = g[g["tokens_trained"] > 0]
    assert set(trained["group"]) == {"cpu-bf16", "cpu-nvfp4"}
    for _, row in trained.iterrows():
        tok, lay = float(row["routing_token_share"]), float(row["routing_layer_share"])
        assert math.isfinite(tok) and 0.0 <= lay <= tok <= 1.0, row.to_dict()
