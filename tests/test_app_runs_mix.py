"""The Runs page draws a run's fleet mix over time (issue 27: a real run re-planned by `replan` shows its groups'
replicas up per update with the `replan` event marked) and lists the re-planning decisions from the run log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("streamlit.testing.v1")
from mixfleet.costmodel.records.runlog import GroupRecord, RunLog, RunLogWriter, UpdateRecord  # noqa: E402
from mixfleet.policies.plan import load_plan  # noqa: E402
from mixfleet.policies.replan import Decision, replan_decisions  # noqa: E402
from streamlit.testing.v1 import AppTest  # noqa: E402

APP = str(Path(__file__).resolve().parents[1] / "ui" / "app.py")
# replicas up per update: the re-planner moves cpu-slow's two replicas to cpu-fast after update 3
MIX = {"cpu-fast": [1.0, 1.0, 1.0, 1.6, 2.0, 2.0], "cpu-slow": [2.0, 2.0, 2.0, 1.2, 0.0, 0.0]}


def _log(folder: Path) -> None:
    w = RunLogWriter(folder, {"source": "runner", "plan": load_plan("data/plans/replan-cpu.toml").to_dict(),
                              "seed": 0}, flush_every_s=None)
    for i in range(6):
        v = i + 1
        for g, xs in MIX.items():
            w.append(GroupRecord(version=v, group=g, replicas_up=xs[i], utilization=0.5, tokens_generated=100,
                                 samples=32, share_of_samples=0.5))
        w.append(UpdateRecord(version=v, start_s=10.0 * v - 2, end_s=10.0 * v, train_step_s=1.5, weight_sync_s=0.5,
                              tokens=100, trajectories=64, staleness_mean=1.0, staleness_p50=1.0, staleness_p95=2.0,
                              staleness_max=2, cost_sampler_usd=0.1 * v, cost_trainer_usd=0.01 * v, reward_mean=0.3))
        if v == 3:
            w.append(Decision(version=3, time_s=30.0, adopted=True, reason="predicted gain 25.00%",
                              trigger="every 2 updates", before={"cpu-fast": 1, "cpu-slow": 2},
                              after={"cpu-fast": 2, "cpu-slow": 0}, gain=0.25, fitted={},
                              predicted={"now": 1.0, "new": 0.75}, window=(0, 3)).record())
    w.flush()
    w.close()


def test_replan_decisions_read_back_from_the_log(tmp_path: Path) -> None:
    _log(tmp_path / "r")
    (d,) = replan_decisions(RunLog.open(tmp_path / "r").events)
    assert (d["version"], d["time_s"], d["adopted"], d["gain"]) == (3, 30.0, True, 0.25)
    assert d["before"] == {"cpu-fast": 1, "cpu-slow": 2} and d["after"] == {"cpu-fast": 2, "cpu-slow": 0}
    assert replan_decisions(RunLog.open(tmp_path / "r").events.iloc[0:0]) == []


def _values(a: dict | list) -> list:
    if isinstance(a, dict):   # plotly sends numpy arrays as base64 `bdata` with their dtype
        import base64

        import numpy as np

        return np.frombuffer(base64.b64decode(a["bdata"]), dtype=a["dtype"]).tolist()
    return list(a)


def test_runs_page_draws_the_mix_over_time_and_the_decisions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    _log(runs / "real")
    monkeypatch.setenv("MIXFLEET_RUNS_DIR", str(runs))
    at = AppTest.from_file(APP, default_timeout=240)
    at.run()
    at.switch_page("app_runs.py")
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    figs = [json.loads(el.proto.spec) for el in at.get("plotly_chart")]
    (fig,) = [f for f in figs if f["layout"]["title"]["text"] == "Timeline"]
    lines = {t["name"]: _values(t["y"]) for t in fig["data"]}
    for g, xs in MIX.items():       # each update's window drawn as a step: every value twice
        assert lines[g] == [x for x in xs for _ in (0, 1)]
    assert _values(lines["replan"]) == [0] and "replan" in lines
    (table,) = [df for df in (e.value for e in at.dataframe) if "predicted gain" in getattr(df, "columns", [])]
    assert table["before"].tolist() == ["cpu-fast 1, cpu-slow 2"]
    assert table["after"].tolist() == ["cpu-fast 2, cpu-slow 0"]
    assert table["adopted"].tolist() == [True]
