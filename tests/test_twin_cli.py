"""`mixfleet plan / simulate / compare` end to end on tiny inputs: JSON outputs, the plan file, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.policies.plan import load_plan, save_plan, with_overrides
from mixfleet.ui.cli import app
from typer.testing import CliRunner

runner = CliRunner()


def test_simulate_writes_a_run_log_and_prints_the_summary(tmp_path: Path) -> None:
    res = runner.invoke(app, ["simulate", "tiny-cpu", "--updates", "3", "--out", str(tmp_path / "log"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["summary"]["updates"] == 3 and out["summary"]["source"] == "twin"
    assert set(out["summary"]["group_share_of_samples"]) == {"cpu-bf16", "cpu-fp8", "cpu-nvfp4"}
    log = RunLog.open(tmp_path / "log")
    assert len(log.updates) == 3 and log.source == "twin"
    table = runner.invoke(app, ["simulate", "tiny-cpu", "--updates", "2"])
    assert table.exit_code == 0 and "share of samples: cpu-fp8" in table.stdout


def test_compare_puts_two_plans_side_by_side(tmp_path: Path) -> None:
    other = save_plan(with_overrides(load_plan("tiny-cpu"), {"name": "tiny-two", "groups.cpu-bf16.replicas": 2}),
                      tmp_path / "tiny-two.toml")
    res = runner.invoke(app, ["compare", "tiny-cpu", str(other), "--updates", "2"])
    assert res.exit_code == 0, res.output
    for needle in ("tiny-cpu", "tiny-two", "cost/update USD", "time/update s", "staleness mean",
                   "share of samples: cpu-nvfp4"):
        assert needle in res.stdout
    js = json.loads(runner.invoke(app, ["compare", "tiny-cpu", str(other), "--updates", "1", "--json"]).stdout)
    assert js["tiny-two"]["summary"]["group_share_of_samples"]["cpu-bf16"] > \
        js["tiny-cpu"]["summary"]["group_share_of_samples"]["cpu-bf16"]


def test_plan_writes_a_plan_that_simulates(tmp_path: Path) -> None:
    out = tmp_path / "plan.toml"
    res = runner.invoke(app, ["plan", "--model", "tiny", "--workload", "tiny-cpu", "--accelerators", "H100,A100-80GB",
                              "--max-gpus", "H100=4", "--trainer", "H100", "--trainer-gpus", "1", "--verify", "0",
                              "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "Chosen mix" in res.stdout and "Pareto set" in res.stdout
    plan = load_plan(out)
    assert plan.model == "tiny" and sum(g.replicas for g in plan.groups if g.accelerator == "H100") <= 4
    assert runner.invoke(app, ["simulate", str(out), "--updates", "1"]).exit_code == 0


def test_bad_input_is_one_clear_line_and_exit_code_2() -> None:
    res = runner.invoke(app, ["simulate", "no-such-plan"])
    assert res.exit_code == 2 and "seed-mixed" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["plan", "--objective", "cheapest", "--verify", "0"])
    assert res.exit_code == 2 and "cost_per_effective_update" in res.output
    res = runner.invoke(app, ["plan", "--max-gpus", "H100:4", "--verify", "0"])
    assert res.exit_code == 2 and "ACCELERATOR=GPUS" in res.output
