"""Issue 24 (second probe): calibration says what of a run log it leaves out, and why.

Before, an unreadable part file was skipped with only the run-log reader's generic warning (nothing in the
calibration's result), and a resumed segment the fit could not use was dropped without a word. Now each is
a `CalibrationWarning` naming the part or segment and the reason, kept in `Calibration.skipped` (and in its
TOML / JSON), and listed when the fit then has too little data.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from mixfleet.costmodel.calibration.fit import calibrate
from mixfleet.costmodel.records.runlog import EventRecord, RunLog, RunLogWriter
from mixfleet.policies.plan import plan_from_dict
from mixfleet.twin.sim import simulate

PLAN = {
    "name": "cal-skip", "seed": 0, "model": "tiny", "workload": "tiny-cpu", "price_table": "modal",
    "trainer": {"accelerator": "CPU-2core", "gpus": 1},
    "groups": [{"name": "cpu-bf16", "accelerator": "CPU-2core", "precision": "bf16", "kv_dtype": "bf16",
                "kernel": "fp32", "emulated": True},
               {"name": "cpu-fp8", "accelerator": "CPU-2core", "precision": "fp8", "emulated": True}],
    "policies": {"batcher": {"name": "fifo", "prompts_per_update": 16, "samples_per_prompt": 8,
                             "inflight_prompts": 32}},
}


@pytest.fixture(scope="module")
def twin_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cal-skip") / "log"
    simulate(plan_from_dict(PLAN), updates=6, out=out)
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "log"
    shutil.copytree(src, dst)
    return dst


def test_an_unreadable_part_is_named_with_why_it_was_skipped(twin_log: Path, tmp_path: Path) -> None:
    from mixfleet.costmodel.calibration.record import CalibrationWarning  # new in this fix

    log = _copy(twin_log, tmp_path)
    part = log / "trajectories" / "part-000000.parquet"
    data = pq.read_table(part)
    n = data.num_rows
    pq.write_table(data.slice(0, n // 2), part)
    second = log / "trajectories" / "part-000001.parquet"
    pq.write_table(data.slice(n // 2), second)
    second.write_bytes(second.read_bytes()[: second.stat().st_size // 2])       # cut: a disk fault, an edit
    with pytest.warns(CalibrationWarning, match=r"part trajectories/part-000001.parquet skipped, its rows are not "
                                                r"in the fit: unreadable \(.*Parquet"):
        cal = calibrate([log])
    assert len(cal.skipped) == 1 and "trajectories/part-000001.parquet" in cal.skipped[0], cal.skipped
    assert cal.to_dict()["skipped"] == list(cal.skipped)
    cal.save(tmp_path / "cal.toml")
    assert cal.load(tmp_path / "cal.toml").skipped == cal.skipped
    assert cal.counts["trajectories"] < len(RunLog.open(twin_log).trajectories)


def test_a_resumed_segment_left_out_is_named_with_why(twin_log: Path, tmp_path: Path) -> None:
    from mixfleet.costmodel.calibration.record import CalibrationWarning

    log = _copy(twin_log, tmp_path)
    end = float(RunLog.open(log).trajectories["end_s"].max())
    with RunLogWriter(log, {}) as w:        # an older runner's resume event (no first_prompt_id), nothing after it
        w.append(EventRecord(time_s=end + 5.0, kind="resume", version=6, detail=json.dumps({"dropped_rows": 0})))
    with pytest.warns(CalibrationWarning, match=rf"the segment resumed at {end + 5.0:.1f} s skipped: no trajectory "
                                                "of it is in the log"):
        cal = calibrate([log])
    assert any("segment resumed" in s for s in cal.skipped)
