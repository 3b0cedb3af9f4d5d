"""The Plan page's result read against its inputs (issue 26 Confusing): the result is shown with the inputs it was
computed from, marked stale when the page's inputs change, and compared with the seed's fleets ("x% cheaper than
seed-mixed"); the twin's cards say they leave the pipeline fill out, which the Dry-run page includes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")


def test_versus_seed_and_changed_inputs_in_words() -> None:
    from mixfleet.ui.app_plan_result import changed_inputs, inputs_text, versus_seed

    chosen = {"cost_per_update_usd": 30.0, "time_per_update_s": 600.0, "staleness_mean": 1.0}
    refs = [{"name": "seed-mixed", "cost_per_update_usd": 40.0, "time_per_update_s": 700.0, "staleness_mean": 2.0},
            {"name": "seed-homogeneous", "cost_per_update_usd": 25.0, "time_per_update_s": 500.0,
             "staleness_mean": 0.5}]
    lines = versus_seed(chosen, refs)
    assert lines[0].startswith("**25% cheaper than seed-mixed** per update ($30.00 vs $40.00")
    assert lines[1].startswith("**20% dearer than seed-homogeneous**")
    assert "staleness 1.00 vs 2.00)" in lines[0]
    bound = versus_seed({**chosen, "staleness_mean": float("nan"), "trainer_bound": True}, refs[:1])
    assert "staleness unbounded vs 2.00)" in bound[0]                         # was "— vs —"
    was = {"model": "m", "max_staleness": 4.0, "kv_dtypes": ("fp8_e4m3",), "calibration": None}
    now = {**was, "max_staleness": 2.0}
    assert changed_inputs(was, now, pool_changed=True) == ["max mean staleness 4.0 -> 2.0", "the accelerator pool"]
    assert inputs_text(was) == "model m · KV dtypes fp8_e4m3 · max mean staleness 4.0 · calibration none"


def test_a_result_shows_its_inputs_and_is_marked_stale_when_they_change(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("MIXFLEET_UI_UPDATES", "2")
    monkeypatch.setenv("MIXFLEET_UI_WORKLOAD", "tiny-cpu")
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.button(key="pl_go").click()
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Chosen mix" in [s.value for s in at.subheader]
    computed = [c.value for c in at.caption if c.value.startswith("Computed from: ")]
    assert len(computed) == 1 and "workload tiny-cpu" in computed[0]
    assert not [w.value for w in at.warning if w.value.startswith("Stale")]
    assert any("than seed-mixed** per update" in m.value for m in at.markdown)
    assert any("the fill and the warm-up are left out" in c.value for c in at.caption)
    mix = at.table[0].value
    stale = at.number_input(key="pl_stale")
    before = stale.value
    stale.set_value(before + 1.0).run()                         # an input changes; the old result stays
    assert not at.exception, [e.value for e in at.exception]
    warn = [w.value for w in at.warning if w.value.startswith("Stale")]
    assert len(warn) == 1 and f"max mean staleness {before or None} -> {before + 1.0}".replace(
        "None", "none") in warn[0], warn
    assert isinstance(at.table[0].value, pd.DataFrame) and at.table[0].value.equals(mix)
    stale.set_value(before).run()                               # back to the inputs it was computed from
    assert not [w.value for w in at.warning if w.value.startswith("Stale")]


def test_runners_up_are_the_pareto_sets_next_mixes_by_cost() -> None:
    from mixfleet.ui.app_plan_result import runners_up

    points = pd.DataFrame({"label": ["a", "b", "c", "d", "e"], "cost_per_update_usd": [30.0, 33.0, 36.0, 45.0, 60.0],
                           "time_per_update_s": [600.0, 540.0, 480.0, 300.0, 200.0],
                           "staleness_mean": [1.0, 1.2, float("nan"), 2.0, 2.5]})
    t = runners_up(points, {"label": "a", "cost_per_update_usd": 30.0, "time_per_update_s": 600.0})
    assert t["mix"].tolist() == ["b", "c", "d"]
    assert t["vs chosen"].tolist() == ["+10% cost, -10% time", "+20% cost, -20% time", "+50% cost, -50% time"]
    assert t["staleness"].tolist() == ["1.20", "unbounded", "2.00"]
