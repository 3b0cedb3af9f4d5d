"""The pages keep what was entered across page switches (issue 44, the newcomer's walk: leaving the Plan page reset
its inputs; the Dry-run page forgot its Plan A choice). Streamlit drops a widget's state when a run does not draw
it; app_common.keep_inputs re-sets the pages' inputs on every run."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")


def _away_and_back(at: AppTest, page: str) -> None:
    at.switch_page("app_runs.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    at.switch_page(page)
    at.run()
    assert not at.exception, [e.value for e in at.exception]


def test_plan_and_dry_run_inputs_outlive_a_page_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(tmp_path / "runs"))
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    at.number_input(key="pl_budget").set_value(1234.0)
    at.number_input(key="pl_stale").set_value(7.5)
    other = next(o for o in at.selectbox(key="pl_model").options if o != at.selectbox(key="pl_model").value)
    at.selectbox(key="pl_model").set_value(other)
    at.run()
    _away_and_back(at, "app_plan.py")
    assert at.number_input(key="pl_budget").value == 1234.0
    assert at.number_input(key="pl_stale").value == 7.5
    assert at.selectbox(key="pl_model").value == other
    assert not at.warning or not any("Session State API" in w.value for w in at.warning)

    at.switch_page("app_dryrun.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    at.radio(key="a_src").set_value("Shipped plan")
    at.run()
    at.selectbox(key="a_name").set_value("tiny-cpu")
    at.number_input(key="dr_n").set_value(3)
    at.run()
    _away_and_back(at, "app_dryrun.py")
    assert at.radio(key="a_src").value == "Shipped plan"
    assert at.selectbox(key="a_name").value == "tiny-cpu"
    assert at.number_input(key="dr_n").value == 3
