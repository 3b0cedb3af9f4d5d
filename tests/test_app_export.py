"""Export to TensorBoard from the Runs page, each run under its own name (issue 44, the newcomer's walk).

Before: no button, link or hint on any page, and the CLI's default logdir for an app run (RUNS/<name>/run) was
RUNS/<name>/tensorboard/run, so every app run showed up in TensorBoard as "run". Now the Runs page's "Export"
writes RUNS/tensorboard/<name> (trackers.default_dest, the CLI's default too), read back here with
TensorBoard's own EventAccumulator."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("streamlit.testing.v1")
pytest.importorskip("tensorboard")
from streamlit.testing.v1 import AppTest  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from test_app_killed_run import _killed_run  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_cli_export_of_an_app_run_is_named_after_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mixfleet.ui.cli import app

    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))
    run = _killed_run(tmp_path / "runs", "first-run")
    res = CliRunner().invoke(app, ["export", str(run), "--to", "tensorboard"])
    assert res.exit_code == 0, res.output
    assert not (run.parent / "tensorboard").exists()
    tb = tmp_path / "runs" / "tensorboard" / "first-run"
    got = _scalars(tb)
    assert got and max(step for v in got.values() for step, _ in v) == 3


def test_runs_page_exports_each_run_under_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))
    _killed_run(runs, "alpha")
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(f"{runs / 'tensorboard' / 'alpha'}" in c.value for c in at.caption)
    at.button(key="runs_export").click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any(s.value.startswith("Exported 3 steps") for s in at.success), [s.value for s in at.success]
    got = _scalars(runs / "tensorboard" / "alpha")
    assert got and all(len(v) >= 1 for v in got.values())
    assert max(step for v in got.values() for step, _ in v) == 3
    assert not (runs / "alpha" / "tensorboard").exists()
