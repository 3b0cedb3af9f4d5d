"""Issue 26's small ones: wide intervals flagged on the Plan page's cards, errors without Python class names,
the calibration table (no "None", no "kept at prior" on a value that moved)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402

CAL = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "fidelity-calibration.toml"


def test_an_interval_wider_than_half_its_value_is_flagged() -> None:
    from mixfleet.ui.app_common import fmt_s
    from mixfleet.ui.app_plan import interval_text

    assert interval_text(10.0, 6.0, fmt_s) == (f"⚠ {fmt_s(10.0)} ± {fmt_s(6.0)}", True)
    assert interval_text(10.0, 4.0, fmt_s) == (f"{fmt_s(10.0)} ± {fmt_s(4.0)}", False)
    # issue 44: one unit on both sides (it read "5.7 min ± 26.41 s")
    assert interval_text(342.0, 26.41, fmt_s) == ("5.7 min ± 0.4 min", False)
    assert interval_text(8000.0, 600.0, fmt_s) == ("2.22 h ± 0.17 h", False)
    assert interval_text(10.0, math.nan, fmt_s)[1] is False        # no interval (too few updates): not flagged


def _page_with_an_error() -> None:
    from mixfleet.ui.app_common import show_error

    show_error("cannot start the run", ValueError("run name 'a b': allowed letters, digits, '.', '_' and '-'"))


def test_errors_show_the_message_and_the_class_only_in_an_expander() -> None:
    at = AppTest.from_function(_page_with_an_error)
    at.run()
    assert [e.value for e in at.error] == ["cannot start the run: run name 'a b': allowed letters, digits, '.', '_' "
                                           "and '-'"]                # was "cannot start the run: ValueError: run..."
    assert at.expander[0].label == "Details"
    assert "builtins.ValueError" in at.expander[0].code[0].value


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
