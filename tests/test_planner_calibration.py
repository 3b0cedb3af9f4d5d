"""The planner takes a calibration: fitted values replace the priors for the groups and trainer it covers.

Uses the calibration test's known "truth" (tests/test_calibration.py: per-group time scales, weight-sync
times, mismatch, trainer scale on the CPU-2core machine) and a pool of CPU-2core precisions.
"""

from __future__ import annotations

import pytest
from mixfleet.costmodel.calibration.record import Calibration
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.fleet import calibrated_group, group_types, metrics
from test_calibration import TRUTH, truth_calibration
from typer.testing import CliRunner

POOL = dict(model="tiny", workload="tiny-cpu", accelerators=("CPU-2core",), trainer_accelerator="CPU-2core",
            trainer_gpus=1, precisions={"CPU-2core": ("bf16", "fp8", "nvfp4")}, emulated=True,
            kv_dtypes=("fp8_e4m3",), verify=0)


@pytest.fixture(scope="module")
def truth() -> Calibration:
    return truth_calibration()


def test_groups_take_the_fitted_values(truth: Calibration) -> None:
    prior = {t.name: t for t in group_types(PlannerConfig(**POOL))}
    cal = {t.name: t for t in group_types(PlannerConfig(**POOL, calibration=truth))}
    assert prior.keys() == cal.keys() and prior
    for name in cal:
        t = cal[name]
        gc = calibrated_group(truth, t.accelerator, t.precision, t.kv_dtype)
        if gc is None:  # bf16 with an fp8 KV cache is not in the calibration: priors stay
            assert t == prior[name]
            continue
        d, sync, kl, _growth, ext = TRUTH[gc.name]
        assert t.sync_s == sync and t.kl_k3 == kl and t.masked_share == ext
        # a slower replica (time scale d > 1) serves fewer tokens/s, a faster one more
        assert (t.tokens_per_s < prior[name].tokens_per_s) == (d > 1.0)


def test_trainer_time_uses_the_calibration(truth: Calibration) -> None:
    import numpy as np

    types = group_types(PlannerConfig(**POOL))
    n = np.full((1, len(types)), 64.0)          # samplers to spare: the update waits on the trainer
    k = np.array([4096])                        # and sessions to spare
    plain = metrics(types, n, k, PlannerConfig(**POOL))
    cal = metrics(types, n, k, PlannerConfig(**POOL, calibration=truth))
    assert plain["trainer_bound"][0] and cal["trainer_bound"][0]
    # the truth's trainer runs at 0.7x the prior's compute time plus 0.5 s: a different step time
    assert cal["time_per_update_s"][0] != pytest.approx(plain["time_per_update_s"][0], rel=1e-3)


def test_cli_plan_says_it_is_calibrated(truth: Calibration, tmp_path) -> None:
    from mixfleet.ui.cli import app

    path = tmp_path / "cal.toml"
    truth.save(path)
    args = ["plan", "-m", "tiny", "-w", "tiny-cpu", "--accelerators", "CPU-2core", "--trainer", "CPU-2core",
            "--trainer-gpus", "1", "--precisions", "CPU-2core=fp8,nvfp4", "--emulated", "--verify", "0",
            "--calibration", str(path)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "calibrated planner" in r.output and "CPU-2core trainer" in r.output
    bad = CliRunner().invoke(app, args[:-1] + [str(tmp_path / "missing.toml")])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
