"""What the pages show reads right (issue 26's "Confusing" and small items, issue 44). The Dry-run page and its
charts: the pipeline fill that makes this page read higher than the Plan page for the same plan, said here; the
side-by-side table in the cards' formats with a difference column; side-by-side subplot titles that do not run
into each other; replica lines with equal counts that do not hide each other; a readable Pareto chart. Numbers in
tables and costs as on the cards; wide intervals flagged on the Plan page's cards; errors without Python class
names."""

from __future__ import annotations

import math

import pandas as pd
import pytest

pytest.importorskip("streamlit")


def test_side_by_side_table_has_the_cards_formats_and_a_difference_column() -> None:
    from mixfleet.ui.app_dryrun import side_by_side_table

    a = {"time_per_update_mean_s": 600.0, "cost_per_update_usd": 2.5, "staleness_mean": 1.0, "tokens_per_s": 32130.0,
         "extreme_share": 0.001}
    b = {"time_per_update_mean_s": 500.0, "cost_per_update_usd": 3.0, "staleness_mean": 1.5, "tokens_per_s": 40000.0,
         "extreme_share": math.nan}
    t = side_by_side_table(a, b, "A: x", "B: y").set_index("metric")
    assert list(t.columns) == ["A: x", "B: y", "difference (B - A)", "B / A"]
    assert t.loc["tokens/s"].tolist() == ["32.1 k", "40 k", "+7.87 k", "1.24x"]          # was 3.213e+04
    assert t.loc["cost per update (USD)"].tolist() == ["$2.50", "$3.00", "+$0.50", "1.20x"]
    # the difference in the unit of the values beside it (issue 44: "−47.70 s" next to minutes)
    assert t.loc["time per update (s)"].tolist() == ["10.0 min", "8.3 min", "−1.7 min", "0.83x"]
    assert t.loc["share outside [0.2, 5]"].tolist()[2:] == ["—", "—"]                     # B has no value
    assert not any("e+" in str(v) for v in t.to_numpy().ravel())


def test_the_dry_run_says_the_pipeline_fill_is_in_and_gives_the_steady_state() -> None:
    from mixfleet.ui.app_dryrun import fill_note

    note = fill_note({"first_update_s": 300.0, "steady_time_per_update_s": 1176.0, "steady_cost_per_update_usd": 61.64})
    assert "the pipeline fill included" in note and "5.0 min" in note
    assert "The Plan page shows the twin's steady state" in note
    assert note.endswith("Steady state of this dry run: 19.6 min and $61.64 per update.")
    no_steady = fill_note({"first_update_s": 3.0, "steady_time_per_update_s": math.nan})
    assert "Steady state of this dry run" not in no_steady


def test_side_by_side_subplot_titles_wrap_their_unit() -> None:
    from mixfleet.ui.app_charts import compare_bars
    from mixfleet.ui.app_dryrun import SIDE_BY_SIDE

    fig = compare_bars([("A", {}), ("B", {})], SIDE_BY_SIDE)
    titles = [a.text for a in fig.layout.annotations]
    assert titles == [t.replace(" (", "<br>(", 1) for t in SIDE_BY_SIDE.values()]
    assert all(len(line) <= 26 for t in titles for line in t.split("<br>"))
    assert fig.layout.margin.t >= 80                                 # room for the two-line titles


def test_replica_lines_with_equal_counts_are_told_apart() -> None:
    from mixfleet.ui.app_charts import timeline

    updates = pd.DataFrame({"version": [1, 2], "end_s": [10.0, 20.0]})
    groups = pd.DataFrame({"version": [1, 2] * 3, "group": ["a", "a", "b", "b", "c", "c"],
                           "replicas_up": [2.0] * 6})                # three groups, every count the same
    fig = timeline(updates, groups, pd.DataFrame({"kind": [], "time_s": [], "group": []}))
    lines = [t for t in fig.data if t.name in ("a", "b", "c")]
    assert len({(t.line.dash, t.line.width) for t in lines}) == 3
    widths = [t.line.width for t in lines]
    assert widths == sorted(widths, reverse=True)                    # the later (on top) thinner: all visible


def test_pareto_chart_stays_readable_with_a_thousand_points() -> None:
    """1,012 Pareto mixes out to 200K s (issue 26: a blob of labels, axes to 200K s): at most 60 drawn, spread over
    the time axis, the axis ends near the chosen mix and the seed's fleets, the rest counted off the chart; only
    the seed's diamonds are labelled, on alternating sides."""
    import numpy as np
    from mixfleet.ui.app_charts import PARETO_MAX_POINTS, PARETO_X_SPAN, pareto

    t = np.geomspace(300.0, 200_000.0, 1012)
    points = pd.DataFrame({"time_per_update_s": t, "cost_per_update_usd": 5e4 / t + 20, "staleness_mean": 1.0,
                           "label": [f"mix {i}" for i in range(len(t))]})
    chosen = {"time_per_update_s": 450.0, "cost_per_update_usd": 131.0}
    refs = [{"name": "seed-mixed", "time_per_update_s": 700.0, "cost_per_update_usd": 70.0, "staleness_mean": 2.0},
            {"name": "seed-homogeneous", "time_per_update_s": 760.0, "cost_per_update_usd": 95.0}]
    twins = [{"name": "seed-mixed (twin)", "time_per_update_s": 1500.0, "cost_per_update_usd": 120.0}]
    fig = pareto(points, chosen=chosen, references=refs, twin_points=twins)
    (front,) = [d for d in fig.data if d.name.startswith("Pareto set")]
    x_hi = PARETO_X_SPAN * 1500.0
    assert len(front.x) <= PARETO_MAX_POINTS and max(front.x) <= x_hi and min(front.x) == 300.0
    assert front.name.endswith(f": {len(front.x)} of 1,012 shown")
    off = int((t > x_hi).sum())
    assert [a.text for a in fig.layout.annotations] == [
        f"{off:,} slower Pareto mixes off the chart (up to 200,000 s) →"]
    by_name = {d.name: d for d in fig.data}
    assert by_name["seed-mixed (twin)"].mode == "markers"                     # named in the legend, no label
    assert {by_name["seed-mixed"].textposition, by_name["seed-homogeneous"].textposition} == {"middle left",
                                                                                              "middle right"}


def test_table_numbers_read_like_the_cards() -> None:
    from mixfleet.ui.app_common import fmt_table

    assert fmt_table(32130.0) == "32.1 k"                   # was 3.213e+04 in the Runs page's tables
    assert fmt_table(1234.5) == "1,234" and fmt_table(0.01234) == "0.01234"
    assert fmt_table(2.5, signed=True) == "+2.5" and fmt_table(-32130.0, signed=True) == "-32.1 k"
    assert fmt_table(math.nan) == "—" and fmt_table(None) == "—"


def test_a_small_cost_is_not_shown_as_zero() -> None:
    """Issue 44: a tiny CPU run's cost per update read "$0.00" on the card while fidelity measured $0.00351."""
    from mixfleet.ui.app_common import fmt_usd

    assert fmt_usd(0.00351) == "$0.0035" and fmt_usd(-0.004) == "-$0.004"
    assert fmt_usd(0.0) == "$0.00" and fmt_usd(2.5) == "$2.50" and fmt_usd(1234.5) == "$1,234.50"
    assert fmt_usd(0.3, 0) == "$0.3" and fmt_usd(61.64, 0) == "$62"


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
    pytest.importorskip("streamlit.testing.v1")
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_function(_page_with_an_error)
    at.run()
    assert [e.value for e in at.error] == ["cannot start the run: run name 'a b': allowed letters, digits, '.', '_' "
                                           "and '-'"]                # was "cannot start the run: ValueError: run..."
    assert at.expander[0].label == "Details"
    assert "builtins.ValueError" in at.expander[0].code[0].value
