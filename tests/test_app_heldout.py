"""The Runs page plots the held-out evaluation (issue 23 / 26: held-out curves where RL people look): reward and
pass@k per evaluated version from the runner's eval events (read by `costmodel.records.trackers.eval_detail`), with the
sampling settings the event records stated under it; an older log that did not record them says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("streamlit.testing.v1")
from mixfleet.costmodel.records.runlog import EventRecord, RunLogWriter, UpdateRecord  # noqa: E402
from mixfleet.policies.plan import load_plan  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")
SETTINGS = {"task": "guess", "temperature": 1.0, "max_new_tokens": 24, "max_turns": 8, "precision": "bf16"}


def _log(folder: Path, with_settings: bool) -> None:
    w = RunLogWriter(folder, {"source": "runner", "plan": load_plan("tiny-cpu").to_dict(), "seed": 0},
                     flush_every_s=None)
    for v in (1, 2, 3, 4):
        w.append(UpdateRecord(version=v, start_s=10.0 * v - 2, end_s=10.0 * v, train_step_s=1.5, weight_sync_s=0.5,
                              tokens=100, trajectories=8, staleness_mean=0.5, staleness_p50=0.0, staleness_p95=1.0,
                              staleness_max=1, cost_sampler_usd=0.1, cost_trainer_usd=0.01, kl_k3=0.01,
                              reward_mean=0.3))
    for v, reward, pk in ((0, 0.25, 0.5), (2, 0.375, 0.75), (2, 0.5, 0.75), (4, 0.625, 1.0)):   # v2 evaluated twice
        d = {"eval": "pass_at_k", "k": 4, "version": v, "pass_at_k": pk, "reward": reward, "problems": 32}
        w.append(EventRecord(time_s=10.0 * v + 1, kind="note", version=v,
                             detail=json.dumps({**d, **(SETTINGS if with_settings else {})})))
    w.append(EventRecord(time_s=1.0, kind="note", detail="not an evaluation"))
    w.flush()
    w.close()


def test_heldout_frame_one_row_per_version_with_its_settings(tmp_path: Path) -> None:
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.ui.app_charts import heldout_frame, heldout_settings

    _log(tmp_path / "r", with_settings=True)
    ev = heldout_frame(RunLog.open(tmp_path / "r").events)
    assert ev["version"].tolist() == [0, 2, 4]
    assert ev["reward"].tolist() == [0.25, 0.5, 0.625]             # the later evaluation of version 2
    assert ev["pass_at_k"].tolist() == [0.5, 0.75, 1.0]
    assert heldout_settings(ev) == ("32 held-out problems x 4 samples (pass@4) of task guess, sampled at "
                                    "temperature 1 from the full vocabulary (no top-p, no top-k), <= 24 new tokens "
                                    "per turn, <= 8 turns, bf16 weights")
    _log(tmp_path / "old", with_settings=False)
    old = heldout_frame(RunLog.open(tmp_path / "old").events)
    assert heldout_settings(old).endswith("its sampling settings are not recorded in this run log (evaluations "
                                          "before 2026-12-01)")


def _values(a: dict | list) -> list:
    """A plotly array as a list (plotly sends numpy arrays as base64 `bdata` with their dtype)."""
    if isinstance(a, dict):
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(a["bdata"]), dtype=a["dtype"]).tolist()
    return list(a)


@pytest.mark.parametrize("with_settings", [True, False])
def test_runs_page_plots_heldout_reward_with_its_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         with_settings: bool) -> None:
    runs = tmp_path / "runs"
    _log(runs / "real", with_settings)
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    figs = [json.loads(el.proto.spec) for el in at.get("plotly_chart")]
    (fig,) = [f for f in figs if f["layout"]["title"]["text"] == "Held-out evaluation"]
    lines = {t["name"]: (_values(t["x"]), _values(t["y"])) for t in fig["data"]}
    assert lines["held-out reward"] == ([0, 2, 4], [0.25, 0.5, 0.625])
    assert lines["held-out pass@k"] == ([0, 2, 4], [0.5, 0.75, 1.0])
    captions = [c.value for c in at.caption if c.value.startswith("Held-out: ")]
    assert len(captions) == 1
    assert ("temperature 1 from the full vocabulary" in captions[0]) is with_settings
