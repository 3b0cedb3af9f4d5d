"""`mixfleet plan --spot` from the shell: the spot mix beside the best on-demand one with the expected lost work,
the source and date of every spot figure, the plan file's spot groups and on_loss, and bad input refused in one
line (exit 2). The tiny model on the tiny-cpu workload, an H100 / A100 pool at RunPod's table, one twin check
of 2 updates per candidate: seconds.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.ui.cli import app
from typer.testing import CliRunner

POOL = ["--model", "tiny", "--workload", "tiny-cpu", "--accelerators", "H100,A100-80GB", "--max-gpus", "H100=4",
        "--max-gpus", "A100-80GB=2", "--trainer", "H100", "--trainer-gpus", "1", "--price-table", "runpod",
        "--verify", "1", "--verify-updates", "2"]


def test_plan_spot_prints_both_mixes_lost_work_and_every_spot_figures_source(tmp_path: Path) -> None:
    out = tmp_path / "spot.toml"
    r = CliRunner().invoke(app, ["plan", *POOL, "--spot-accelerators", "h100", "--on-loss", "restart", "-o", str(out)],
                           env={"COLUMNS": "250"})                     # rich wraps tables to the terminal
    assert r.exit_code == 0, r.output
    cat = load_catalog("runpod")
    assert "With and without spot" in r.output and "on-demand only" in r.output
    assert f"spot figures: {cat.spot_source} ({cat.spot_date})" in r.output
    assert "H100 $0.99/GPU-h (on-demand $3.29), 0.00031 preemptions/replica-h (estimates)" in r.output
    assert "twin checks: 2 (2 candidates x 1 seeds) on " in r.output
    plan = tomllib.loads(out.read_text())
    assert all(g["spot"] for g in plan["groups"]) and plan["faults"]["on_loss"] == "restart"

    j = CliRunner().invoke(app, ["plan", *POOL, "--spot-accelerators", "H100", "--json"])
    assert j.exit_code == 0, j.output
    d = json.loads(j.stdout[j.stdout.index("{"):])
    assert all(g.endswith("-SPOT") for g in d["best"]["replicas"])
    assert d["on_demand"] and not any(g.endswith("-SPOT") for g in d["on_demand"]["replicas"])
    assert d["best"]["lost_work"]["preemptions_per_update"] > 0 and d["on_demand"]["lost_work"]["lost_share"] == 0
    assert d["spot_source"]["accelerators"]["H100"] == {"usd_per_gpu_hour": 0.99, "on_demand_usd_per_gpu_hour": 3.29,
                                                         "preemptions_per_hour": 0.00031, "estimate": True}
    assert d["checks"]["tasks"] == 2   # run on this machine's cores, or read back from the check cache


def test_plan_spot_bad_input_is_one_line_exit_2() -> None:
    r = CliRunner().invoke(app, ["plan", *POOL[:-4], "--price-table", "modal", "--spot"])
    assert r.exit_code == 2 and "spot" in r.output and "'modal' has none" in r.output
    r = CliRunner().invoke(app, ["plan", *POOL, "--spot-accelerators", "H900"])
    assert r.exit_code == 2 and "H900" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["plan", *POOL, "--on-loss", "retry"])
    assert r.exit_code == 2 and "on_loss" in r.output and "resume" in r.output
