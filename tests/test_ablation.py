"""A test-sized ablation study for real: 2 variants (GRPO, SC+MIS+top-p) x 1 fleet x 1 seed x 2 updates, each a
real run (Ray actors, embedded samplers, Megatron-core trainer) in its own child process, then the report.

Checked: one finished run log per variant with updates 1..2; the two runs' plans are identical except the
loss (trainer.loss / top_p / top_p_replay) and name; the header seeds match; a second call skips both (nothing
started); asking for more updates without resume refuses, naming --resume; the report reads both runs.
About 3-5 minutes on 2 busy cores (the two Ray start-ups dominate).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.runner.checkpoint.init_model import init_model
from mixfleet.studies.ablation import ABLATION_FILE, RUN_FILE, AblationConfig, run_ablation
from mixfleet.studies.ablation_report import build_report

PLAN = """
base = "ablation-homogeneous"
name = "test-ablation"
[[groups]]
name = "cpu-bf16"
replicas = 1
[policies.batcher]
name = "fifo"
prompts_per_update = 2
samples_per_prompt = 2
inflight_prompts = 2
[embedded]
max_replicas_per_group = 1
max_turns = 3
max_new_tokens = 8
"""


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[AblationConfig, dict]:
    root = tmp_path_factory.mktemp("ablation")
    init = init_model(load_model_spec("tiny"), root / "init", seed=0)
    plan = root / "plan.toml"
    plan.write_text(PLAN)
    cfg = AblationConfig(out_dir=root / "study", fleets=("homogeneous",), variants=("grpo", "sc_mis_topp"),
                         seeds=(0,), updates=2, base_policy=str(init), plans={"homogeneous": str(plan)},
                         start_gap_s=0.0, run_timeout_s=900.0)
    return cfg, run_ablation(cfg, log=lambda _: None)


def test_one_finished_log_per_variant(study: tuple[AblationConfig, dict]) -> None:
    cfg, manifest = study
    assert {k: v["state"] for k, v in manifest["runs"].items()} == {
        "homogeneous/grpo/seed0": "finished", "homogeneous/sc_mis_topp/seed0": "finished"}
    assert json.loads((cfg.out_dir / ABLATION_FILE).read_text())["runs"] == manifest["runs"]
    plans, seeds = {}, set()
    for v in ("grpo", "sc_mis_topp"):
        run = cfg.out_dir / "homogeneous" / v / "seed0"
        log = RunLog.open(run)
        assert log.header["status"] == "finished"
        assert log.updates["version"].tolist() == [1, 2]
        assert set(log.trajectories["trained_version"]) - {-1} == {1, 2}
        assert json.loads((run / RUN_FILE).read_text())["variant"] == v
        assert not (run / "weights").exists()                       # the log stays, the weights go
        plans[v] = log.header["plan"]
        seeds.add(log.header["seed"])
    assert seeds == {0}
    t = {v: plans[v].pop("trainer") for v in plans}
    assert (t["grpo"]["loss"], t["grpo"]["top_p"], t["grpo"]["top_p_replay"]) == ("grpo", 1.0, False)
    assert (t["sc_mis_topp"]["loss"], t["sc_mis_topp"]["top_p"], t["sc_mis_topp"]["top_p_replay"]) == \
        ("sc_mis", 0.95, True)
    for d in plans.values():
        d.pop("name")
    assert plans["grpo"] == plans["sc_mis_topp"]


def test_finished_runs_are_skipped_and_partial_ones_need_resume(study: tuple[AblationConfig, dict]) -> None:
    cfg, _ = study
    lines: list[str] = []
    manifest = run_ablation(cfg, log=lines.append)
    assert "2 finished, 0 to run" in lines[0] and not any("start" in x for x in lines[1:])
    assert all(v["state"] == "finished" for v in manifest["runs"].values())
    more = AblationConfig(**{**cfg.__dict__, "updates": 3})
    with pytest.raises(ValueError, match="--resume"):
        run_ablation(more, log=lambda _: None)


def test_report_reads_the_study(study: tuple[AblationConfig, dict], tmp_path: Path) -> None:
    cfg, _ = study
    res = build_report(cfg.out_dir, tmp_path, plots=False)
    assert [(v["variant"], v["updates"]) for v in res["verdicts"]] == [("grpo", 2), ("sc_mis_topp", 2)]
    text = (tmp_path / "README.md").read_text()
    assert "| GRPO | 0 | 2 |" in text and "| SC+MIS+top-p | 0 | 2 |" in text
