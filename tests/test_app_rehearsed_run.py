"""A rehearsed GPU plan is not compared with the GPU plan's twin (issue 44, the newcomer's walk).

"Run for real" of a GPU plan runs it as embedded samplers on this machine's CPU cores (runner/orchestration/
rehearsal.py); the run log's plan keeps each group's GPU (for its prices). Before the fix the Runs page overlaid
the planner's twin of the GPU fleet (same plan name), "Predicted vs measured" read tokens/s +146,405 %, and twin
fidelity (the app and `mixfleet fidelity`, one function: twin.calibrated.fidelity) simulated GPUs: +1247.5 %.
Now both say plainly that the twin does not apply to such a run; a CPU plan's run is still checked. The log here
is written record by record the way the runner writes it, with the header a rehearsal of seed-mixed gets."""

from __future__ import annotations

from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import GroupRecord, RunLogWriter, TrajectoryRecord, UpdateRecord
from mixfleet.policies.plan import load_plan
from mixfleet.runner.orchestration.rehearsal import Machine, rehearsal_of
from typer.testing import CliRunner

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")


def _log(folder: Path, plan: dict, fleet_mode: str, updates: int = 2) -> None:
    groups = [g["name"] for g in plan["groups"]]
    header = {"source": "runner", "plan": plan, "seed": 0,
              "runner": {"mode": "async", "fleet_mode": fleet_mode, "task": "guess", "updates": updates,
                         "groups": {g: {"replicas": 1, "planned_replicas": 1} for g in groups}}}
    w = RunLogWriter(folder, header, flush_every_s=None)
    pid, end = 0, 2.0
    for v in range(1, updates + 1):
        for g in groups:
            w.append(TrajectoryRecord(run_id=w.run_id, prompt_id=pid, sample_index=0, group=g, replica=0,
                                      version_start=v - 1, version_end=v - 1, turns=2, prompt_tokens=40,
                                      generated_tokens=30, start_s=end, end_s=end + 9, reward=0.5,
                                      finish_reason="done", trained_version=v))
            pid += 1
        end += 10.0
        w.append(UpdateRecord(version=v, start_s=end - 3, end_s=end, train_step_s=2.0, weight_sync_s=1.0, tokens=300,
                              trajectories=len(groups), staleness_mean=0.5, staleness_p50=0.0, staleness_p95=1.0,
                              staleness_max=1, cost_sampler_usd=0.01 * v, cost_trainer_usd=0.002 * v, kl_k3=0.001,
                              reward_mean=0.5))
        for g in groups:
            w.append(GroupRecord(version=v, group=g, replicas_up=1.0, utilization=0.9, tokens_generated=30,
                                 samples=1, share_of_samples=1 / len(groups)))
    w.flush()
    w.close()


def _form_page() -> None:
    import os
    import tomllib
    from pathlib import Path

    from mixfleet.ui.app_common import PlanText
    from mixfleet.ui.app_launch import run_for_real

    text = Path(os.environ["MIXFLEET_TEST_FORM_PLAN"]).read_text()
    run_for_real(PlanText(tomllib.loads(text)["name"], text), "t")


def _rehearsed_plan() -> dict:
    return rehearsal_of(load_plan("seed-mixed"), Machine(cores=2, memory_bytes=8 << 30)).plan.to_dict()


def test_cli_fidelity_refuses_a_rehearsal_of_a_gpu_plan(tmp_path: Path) -> None:
    from mixfleet.ui.cli import app

    _log(tmp_path / "r", _rehearsed_plan(), "embedded")
    res = CliRunner().invoke(app, ["fidelity", "--runlog", str(tmp_path / "r")])
    out = res.output
    assert res.exit_code != 0, out
    assert "embedded rehearsal" in out and "do not apply" in out and "Traceback" not in out, out
    assert "%" not in out.replace("146,405 %", "")        # no error figure printed


def test_cli_fidelity_still_checks_a_cpu_plan_rehearsed_as_written(tmp_path: Path) -> None:
    from mixfleet.ui.cli import app

    _log(tmp_path / "r", load_plan("tiny-cpu").to_dict(), "embedded")
    res = CliRunner().invoke(app, ["fidelity", "--runlog", str(tmp_path / "r"), "--json"])
    assert res.exit_code == 0, res.output
    assert '"time_per_update_mean_s"' in res.output


def test_runs_page_says_the_twin_does_not_apply_and_overlays_nothing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from mixfleet.twin.sim import simulate

    runs = tmp_path / "runs"
    plan = _rehearsed_plan()
    _log(runs / "real", plan, "embedded", updates=1)
    # the planner's twin of the GPU plan under the same name (what the page overlaid before)
    simulate(load_plan("seed-mixed"), updates=2, seed=0, out=runs / "twin-seed-mixed")
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox[0].value.endswith("real") or "real" in str(at.selectbox[0].value)
    infos = [i.value for i in at.info]
    assert any(i.startswith("No twin overlay or predicted-vs-measured table:") and "embedded rehearsal" in i
               for i in infos), infos
    assert any(i.startswith("Twin fidelity does not apply:") for i in infos), infos
    assert not [s for s in at.selectbox if s.label == "Overlay the twin's prediction"]
    assert not [b for b in at.button if b.label == "Check the twin against this run"]
    assert not [h for h in at.subheader if h.value == "Predicted vs measured"]


def test_the_rehearsal_caption_says_which_task_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tomli_w

    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(tmp_path / "runs"))
    plan = tmp_path / "plan.toml"
    plan.write_text(tomli_w.dumps(load_plan("seed-mixed").to_dict()))
    monkeypatch.setenv("MIXFLEET_TEST_FORM_PLAN", str(plan))
    at = AppTest.from_function(_form_page, default_timeout=120)
    at.run()
    assert not at.exception
    heads = [m.value for m in at.markdown if "Embedded rehearsal here" in m.value]
    assert heads and heads[0].endswith("task **guess**"), heads
