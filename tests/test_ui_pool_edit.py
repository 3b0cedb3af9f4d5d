"""The Plan page's accelerator pool: prices per GPU-hour and allowed precisions are editable in the table,
reach the planner (the written plan carries the edited prices), and bad precisions show the planner's
validation error in the page. Kept quick like test_ui_apptest.py: the tiny-cpu workload, 2-update dry
runs, and the seed's reference fleets switched off.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("streamlit.testing.v1")
from mixfleet.costmodel.errors import SpecError  # noqa: E402
from mixfleet.costmodel.specs.catalog import load_catalog  # noqa: E402
from mixfleet.ui import app_planner  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")
TIMEOUT_S = 240


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    runs = tmp_path / "runs"
    runs.mkdir()
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_UI_UPDATES", "2")
    monkeypatch.setenv("MIXFLEET_UI_WORKLOAD", "tiny-cpu")
    return runs


def _app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=TIMEOUT_S)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    at.toggle(key="pl_refs").set_value(False)  # no reference fleets: one twin dry run per plan
    at.run()
    return at


def _edit(at: AppTest, rows: dict[int, dict]) -> None:
    pool = at.data_editor[0]
    at.session_state[pool.key] = {"edited_rows": rows, "added_rows": [], "deleted_rows": []}
    at.run()
    assert not at.exception, [e.value for e in at.exception]


def _plan(at: AppTest) -> tuple[pd.DataFrame, dict, dict]:
    at.button(key="pl_go").click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    view = at.session_state["plan_result"]
    return at.table[0].value, view.chosen_point, tomllib.loads(at.session_state["planned_plan"].toml)


def _row(at: AppTest, accelerator: str) -> int:
    return list(at.data_editor[0].value["accelerator"]).index(accelerator)


def test_pool_overrides_are_what_the_table_changed() -> None:
    cat = load_catalog("modal")
    pool = pd.DataFrame([
        {"use": True, "accelerator": "H100", "usd_per_gpu_hour": 1.25, "max_gpus": 8, "precisions": ["fp8"]},
        {"use": True, "accelerator": "B200", "usd_per_gpu_hour": cat.accelerator("B200").price_usd_per_gpu_hour,
         "max_gpus": 8, "precisions": ["mxfp4", "nvfp4", "fp8", "bf16"]},          # unchanged (order aside)
        {"use": False, "accelerator": "A100-80GB", "usd_per_gpu_hour": 0.5, "max_gpus": 8, "precisions": []},
    ])
    prices, precisions = app_planner.pool_overrides(pool, "modal")
    assert prices == {"H100": 1.25, "A100-80GB": 0.5}          # a price counts even for an unticked row
    assert precisions == {"H100": ("fp8",)}                     # only ticked rows restrict precisions
    app_planner.check_pool(pool, "modal")
    bad = pool.assign(precisions=[["nvfp4"], ["bf16"], []])
    with pytest.raises(SpecError, match="precisions.H100"):
        app_planner.check_pool(bad, "modal")
    app_planner.check_pool(bad, "modal", emulated=True)        # nvfp4 is emulable on Hopper


def test_editing_a_price_in_the_pool_changes_the_chosen_mix_and_its_cost(env: Path) -> None:
    at = _app()
    mix0, point0, plan0 = _plan(at)
    assert "prices" not in plan0
    accs0 = set(mix0["accelerator"])
    # make every accelerator the default mix uses 50x dearer: the planner must move away or pay more
    _edit(at, {_row(at, a): {"usd_per_gpu_hour": 50 * load_catalog("modal").accelerator(a).price_usd_per_gpu_hour}
               for a in accs0})
    assert not at.error, [e.value for e in at.error]
    mix1, point1, plan1 = _plan(at)
    changed_mix = set(mix1["accelerator"]) != accs0
    assert changed_mix or point1["cost_per_update_usd"] > 10 * point0["cost_per_update_usd"]
    carried = {a: usd for a, usd in plan1.get("prices", {}).items() if a in set(mix1["accelerator"])}
    for a in set(mix1["accelerator"]) & accs0:                  # the plan carries the edited prices it uses
        assert carried[a] == pytest.approx(50 * load_catalog("modal").accelerator(a).price_usd_per_gpu_hour)


def test_bad_allowed_precisions_show_the_planner_error_in_the_page(env: Path) -> None:
    at = _app()
    _edit(at, {_row(at, "H100"): {"precisions": ["nvfp4"]}})
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "invalid accelerator pool" in errors[0] and "precisions.H100" in errors[0]
    assert "bf16, fp8" in errors[0] and "Traceback" not in errors[0]
    assert not at.button                                        # nothing to run until the pool is valid
    at.toggle(key="pl_emul").set_value(True)                    # emulated formats allowed: valid again
    at.run()
    assert not at.error, [e.value for e in at.error]
    assert [b.key for b in at.button if b.key == "pl_go"] == ["pl_go"]
