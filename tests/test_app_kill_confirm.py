"""Kill now asks first and sits away from Stop (issue 44, the newcomer's walk: "Kill now acts at once, one button
from Stop"). The run is the killed-run fixture's log with its managed record taken as alive, and `rm.kill` is
recorded instead of sending SIGKILL: what is checked is the page's controls, not the signal (that one is
tests/test_ui_run_manager.py's, for real)."""

from __future__ import annotations

from pathlib import Path

import pytest
from mixfleet.ui import run_manager as rm

pytest.importorskip("streamlit.testing.v1")
from streamlit.testing.v1 import AppTest  # noqa: E402
from test_app_killed_run import _killed_run  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")


def test_kill_now_asks_before_it_kills(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))
    _killed_run(runs, "going")
    monkeypatch.setattr(rm.ManagedRun, "alive", lambda self: True)        # a running managed run
    killed: list[str] = []
    monkeypatch.setattr(rm, "kill", lambda m: killed.append(m.name))
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    labels = [b.label for b in at.button]
    assert "Stop (after this update)" in labels and "Kill now" in labels, labels
    at.button(key="mr_going_kill").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert killed == []                                                   # one press does not kill
    assert any(w.value.startswith("Kill `going` now?") for w in at.warning), [w.value for w in at.warning]
    at.button(key="mr_going_kill_cancel").click().run()
    assert killed == [] and "Kill now" in [b.label for b in at.button]
    at.button(key="mr_going_kill").click().run()
    at.button(key="mr_going_kill_confirm").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert killed == ["going"]


def test_kill_now_is_not_beside_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))
    _killed_run(runs, "going")
    monkeypatch.setattr(rm.ManagedRun, "alive", lambda self: True)
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    (row,) = [blk for blk in _walk(at._tree) if _columns(blk)
              and any(getattr(x, "key", None) == "mr_going_stop" for x in _walk(blk))
              and not any(_columns(c) and any(getattr(x, "key", None) == "mr_going_stop" for x in _walk(c))
                          for c in _walk(blk) if c is not blk)]
    cols = _columns(row)
    where = {getattr(x, "key", None): i for i, c in enumerate(cols) for x in _walk(c)}
    assert where["mr_going_stop"] == 0 and where["mr_going_kill"] == len(cols) - 1 >= 2, where


def _columns(node):  # type: ignore[no-untyped-def]
    """The columns directly under `node` (a row of st.columns), else []."""
    kids = list(getattr(node, "children", {}).values())
    return kids if kids and all(type(k).__name__ == "Column" for k in kids) else []


def _walk(node):  # type: ignore[no-untyped-def]
    yield node
    for child in getattr(node, "children", {}).values():
        yield from _walk(child)
