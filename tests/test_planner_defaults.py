"""One set of planner defaults for the app and the CLI (issue 26): `planner.defaults.DEFAULTS` is what
`mixfleet plan`'s options default to, what the Plan page's inputs start at (and show), and what PlannerConfig
takes; planned with nothing changed, the two front ends choose the same mix.

The end-to-end case drives the Plan page headless (Streamlit's AppTest) and `mixfleet plan` (typer's
CliRunner) on the tiny-cpu workload (the app's MIXFLEET_UI_WORKLOAD override and `--workload tiny-cpu`, the
one input both change, so that the planner and its twin checks take seconds).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest
import typer
from mixfleet.planner.config import PlannerConfig
from mixfleet.planner.defaults import DEFAULTS
from mixfleet.ui.cli import app as cli_app
from typer.testing import CliRunner

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")
TIMEOUT_S = 600
CLI_FLAGS = {"model": "--model", "workload": "--workload", "price_table": "--price-table",
             "default_max_gpus": "--default-max-gpus", "trainer_accelerator": "--trainer",
             "trainer_gpus": "--trainer-gpus", "max_staleness": "--max-staleness",
             "max_time_per_update_s": "--max-time-per-update", "max_usd_per_hour": "--budget",
             "objective": "--objective", "verify": "--verify", "verify_updates": "--verify-updates",
             "verify_seeds": "--verify-seeds", "seed": "--seed", "layouts": "--layouts", "backend": "--backend",
             "emulated": "--emulated", "on_loss": "--on-loss", "workers": "--workers"}


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_UI_WORKLOAD", "tiny-cpu")
    return runs


def test_planner_config_and_cli_options_default_to_the_one_set() -> None:
    cfg_fields = {f.name: f.default for f in dataclasses.fields(PlannerConfig)}
    for name, value in DEFAULTS.to_dict().items():
        if name != "workers":                         # how the checks run, not what is planned
            assert cfg_fields[name] == value, name
    plan = typer.main.get_command(cli_app).commands["plan"]
    by_flag = {opt: p for p in plan.params for opt in p.opts}
    for name, flag in CLI_FLAGS.items():
        default = by_flag[flag].default
        want = getattr(DEFAULTS, name)
        assert default == want, (flag, default, want)
    assert by_flag["--kv-dtypes"].default == ",".join(DEFAULTS.kv_dtypes)
    assert not by_flag["--spot"].default and not by_flag["--spot-accelerators"].default   # on-demand only


def test_plan_page_inputs_start_at_the_one_set_and_show_it(env: Path) -> None:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="pl_model").value == DEFAULTS.model
    assert at.number_input(key="pl_stale").value == (DEFAULTS.max_staleness or 0.0)
    assert at.number_input(key="pl_tpu").value == (DEFAULTS.max_time_per_update_s or 0.0)
    assert at.number_input(key="pl_budget").value == (DEFAULTS.max_usd_per_hour or 0.0)
    assert at.number_input(key="pl_tn").value == DEFAULTS.verify_updates
    assert at.selectbox(key="pl_tacc").value == DEFAULTS.trainer_accelerator
    assert at.number_input(key="pl_tgpus").value == DEFAULTS.trainer_gpus
    assert at.selectbox(key="pl_backend").value == DEFAULTS.backend
    assert at.selectbox(key="pl_layouts").value == DEFAULTS.layouts
    assert at.multiselect(key="pl_kv").value == list(DEFAULTS.kv_dtypes)
    assert at.toggle(key="pl_emul").value == DEFAULTS.emulated
    assert any(DEFAULTS.describe() in c.value for c in at.caption)    # shown on the page


@pytest.mark.slow
def test_app_and_cli_defaults_choose_the_same_mix(env: Path) -> None:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.run()
    at.button(key="pl_go").click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    page = tomllib.loads(at.session_state["planned_plan"].toml)
    page_mix = {g["name"]: g["replicas"] for g in page["groups"]}

    r = CliRunner().invoke(cli_app, ["plan", "--workload", "tiny-cpu", "--json"])
    assert r.exit_code == 0, r.output
    cli = json.loads(r.stdout[r.stdout.index("{"):])
    assert cli["best"]["replicas"] == page_mix
    assert cli["best"]["inflight_prompts"] == page["policies"]["batcher"]["inflight_prompts"]
    assert len(cli["verified"]) == DEFAULTS.verify                      # the CLI verified as many as the page
