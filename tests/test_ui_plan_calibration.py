"""'Plan with this calibration' says what the calibration covers and what it changes (issue 26 item 3), AppTest.

The calibration is the real one fitted on tiny-cpu runs (benchmarks/results/fidelity-calibration.toml): CPU
groups of the tiny model and a CPU trainer, so in the default GPU pool it matches nothing. Before, the Plan page
said "its fitted values replace the priors for the groups and trainer it covers" and planned on the priors.

The calibration table (issue 26, issue 44): no "None", no "kept at prior" on a value that moved, a round-off zero
shown as zero, a value far from its prior flagged.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
APP = str(ROOT / "ui" / "app.py")
CAL = ROOT / "benchmarks" / "results" / "fidelity-calibration.toml"


@pytest.fixture()
def cal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    runs = tmp_path / "runs"
    runs.mkdir()
    path = tmp_path / "tiny-calibration.toml"
    shutil.copy(CAL, path)
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_CALIBRATION", str(path))
    monkeypatch.setenv("MIXFLEET_UI_UPDATES", "2")
    return str(path)


def test_a_cpu_calibration_says_it_changes_nothing_in_a_gpu_pool(cal: str) -> None:
    from mixfleet.ui.app_plan import CALIBRATION_REQUEST_KEY

    at = AppTest.from_file(APP, default_timeout=240)
    at.session_state[CALIBRATION_REQUEST_KEY] = cal       # what "Plan with this calibration" sets
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="pl_cal").value == cal
    notice = [w.value for w in at.warning if "Calibration `" in w.value]
    assert notice, [w.value for w in at.warning]
    text = notice[0]
    assert "fitted on model **tiny**" in text and "CPU-2core" in text          # what it covers
    assert "changes nothing" in text and "does not apply" in text              # what it changes here
    assert "the model here is qwen3.6-35b-a3b, not the calibrated tiny" in text
    # its own setup offered (issue 44: "Plan its model" switched only the model, so a CPU calibration could never
    # change a plan in the app): the model, the measured workload, the CPU pool, precisions and trainer it ran
    offer = [b for b in at.button if b.label == "Plan its setup (tiny on CPU-2core, its measured workload)"]
    assert offer and not [b for b in at.button if b.label.startswith("Plan its model")]
    offer[0].click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.selectbox(key="pl_model").value == "tiny"
    assert Path(at.selectbox(key="pl_workload").value).name.startswith("workload-tiny-cpu-measured-")
    assert at.selectbox(key="pl_tacc").value == "CPU-2core" and at.toggle(key="pl_emul").value
    text = next(i.value for i in at.info if "Calibration `" in i.value)
    assert "its fitted values replace the priors for CPU-2core bf16 (KV bf16), CPU-2core fp8 (KV fp8_e4m3), " \
           "CPU-2core nvfp4 (KV fp8_e4m3)" in text and "the trainer's fit applies" in text
    at.button(key="pl_go").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Chosen mix (calibrated)" in [s.value for s in at.subheader]
    mix = [tb for tb in at.table if "accelerator" in tb.value.columns]
    assert mix and set(mix[0].value["accelerator"]) == {"CPU-2core"}, mix[0].value
    at.button(key="pl_setup_off").click().run()                                # and back
    assert not at.exception and "Calibration `" in next(w.value for w in at.warning if "Calibration `" in w.value)


def test_a_calibration_that_covers_the_trainer_says_so_and_the_plan_is_marked_calibrated(cal: str) -> None:
    import pandas as pd
    from mixfleet.ui.app_plan import calibration_coverage

    pool = pd.DataFrame([{"use": True, "accelerator": "H100", "max_gpus": 8, "precisions": ["fp8"]}])
    changes, covers, what = calibration_coverage(cal, "tiny", pool, ("fp8_e4m3",), "CPU-2core")
    assert changes and "the trainer's fit applies" in what and "no candidate of this pool" in what
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.selectbox(key="pl_cal").set_value(cal).run()
    at.button(key="pl_go").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Chosen mix (calibrated)" in [s.value for s in at.subheader]
    assert any(f"Planned with calibration `{cal}`" in c.value for c in at.caption)


def test_the_calibration_table_has_no_none_and_a_moved_value_is_not_kept_at_prior() -> None:
    from mixfleet.costmodel.calibration.record import Calibration
    from mixfleet.ui.app_launch import _fitted_rows

    rows = _fitted_rows(Calibration.load(CAL))
    assert rows and all(r[k] is not None for r in rows for k in r), [r for r in rows if None in r.values()]
    pre = [r for r in rows if r["parameter"] == "prefill_overhead_s"]
    assert pre and all(r["source"] == "derived (moved from the prior)" for r in pre
                       if not math.isclose(r["fitted"], r["prior"])), pre
    kept = [r for r in rows if r["source"] == "kept at prior"]
    assert all(math.isclose(r["fitted"], r["prior"], rel_tol=1e-9, abs_tol=1e-12) for r in kept), kept


def test_the_calibration_table_shows_a_round_off_zero_as_zero() -> None:
    """Issue 44: a value fitted at its bound of 0 read '1.178e-19 +- 0.029' in the table."""
    import dataclasses

    from mixfleet.costmodel.calibration.record import Calibration, Fitted
    from mixfleet.ui.app_launch import _fitted_rows

    cal = Calibration.load(CAL)
    name = next(f.name for f in dataclasses.fields(cal) if isinstance(getattr(cal, f.name), Fitted))
    cal = dataclasses.replace(cal, **{name: dataclasses.replace(getattr(cal, name), value=1.178e-19, stderr=0.029)})
    row = next(r for r in _fitted_rows(cal) if r["where"] == "shared" and r["parameter"] == name)
    assert row["fitted"] == 0.0 and row["± (1σ)"] == 0.029


def test_the_calibration_table_flags_a_value_far_from_its_prior() -> None:
    """Issue 44: a trainer fitted 11x slower than its prior went unremarked in the table."""
    import dataclasses

    from mixfleet.costmodel.calibration.record import Calibration, Fitted
    from mixfleet.ui.app_launch import _fitted_rows, far_from_prior

    cal = Calibration.load(CAL)
    rows = _fitted_rows(cal)
    assert all(r["fitted / prior"] == pytest.approx(r["fitted"] / r["prior"]) for r in rows
               if r["prior"] > 0 and math.isfinite(r["prior"]))
    name = next(f.name for f in dataclasses.fields(cal) if isinstance(getattr(cal, f.name), Fitted)
                and (getattr(cal, f.name).prior or 0) > 0)
    v = getattr(cal, name)
    moved = dataclasses.replace(cal, **{name: dataclasses.replace(v, value=11 * v.prior, fitted=True, note="")})
    flagged = far_from_prior(_fitted_rows(moved))
    assert f"`{name}` (shared): 11x its prior" in flagged
    near = dataclasses.replace(cal, **{name: dataclasses.replace(v, value=2 * v.prior, fitted=True, note="")})
    assert not any(f"`{name}` (shared)" in x for x in far_from_prior(_fitted_rows(near)))
