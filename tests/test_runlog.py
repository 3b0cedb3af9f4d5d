"""Run-log format: every table round-trips (values and dtypes), empty tables keep their columns, a log cut
mid-write (garbage part, leftover temp file, a writer killed with SIGKILL) reads up to its last complete
part, resume continues the part numbering without losing or duplicating rows, bad enums are refused
with the allowed values, and plain pandas / pyarrow read the tables. Bad logs (issue 13): a part of another schema
is skipped with a warning, a corrupt run.json is reported as corrupt, and finding run logs is bounded."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from dataclasses import asdict, fields
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import (
    EVENT_KINDS,
    FINISH_REASONS,
    SCHEMAS,
    TABLES,
    EventRecord,
    GroupRecord,
    RunLog,
    RunLogWarning,
    RunLogWriter,
    TrajectoryRecord,
    UpdateRecord,
)
from mixfleet.ui.cli import app
from typer.testing import CliRunner

runner = CliRunner()


def traj(i: int, **kw) -> TrajectoryRecord:
    base = dict(run_id="r1", prompt_id=f"p{i // 4}", sample_index=i % 4, group=("bf16", "fp8")[i % 2],
                replica=i % 3, version_start=i // 5, version_end=i // 5 + (i % 2), turns=3 + i,
                prompt_tokens=100 + i, generated_tokens=50 + 2 * i, start_s=0.5 * i, end_s=0.5 * i + 7.25,
                reward=float(i % 2), finish_reason=FINISH_REASONS[i % len(FINISH_REASONS)], restarts=i % 2,
                tokens_by_version=None if i % 3 == 0 else {i // 5: 10 + i, i // 5 + 1: 40 + i},
                trained_version=i // 5 + 2)
    base.update(kw)
    return TrajectoryRecord(**base)


def update(v: int, **kw) -> UpdateRecord:
    base = dict(version=v, start_s=10.0 * v - 3, end_s=10.0 * v, train_step_s=2.5, weight_sync_s=0.5,
                tokens=1000 + v, trajectories=32, staleness_mean=0.5 * v, staleness_p50=float(v),
                staleness_p95=v + 1.0, staleness_max=v + 2.0, cost_sampler_usd=1.5 * v, cost_trainer_usd=0.25 * v,
                kl_k1=0.001 * v, kl_k3=0.002 * v, masked_share=0.01, extreme_low_share=0.003,
                extreme_high_share=0.004, ess=0.9, entropy=1.2, grad_norm=0.7, loss=-0.1, reward_mean=0.1 * v,
                pass_at_k=None if v % 2 else 0.5)
    base.update(kw)
    return UpdateRecord(**base)


def group(v: int, name: str, **kw) -> GroupRecord:
    base = dict(version=v, group=name, replicas_up=2.5, utilization=0.75, tokens_generated=300 + v, samples=16,
                share_of_samples=0.5, kl_k3=0.003, extreme_share=None, cost_usd=0.6, kl_k1=0.002,
                masked_share=0.02, staleness_mean=1.5, tokens_trained=500)
    base.update(kw)
    return GroupRecord(**base)


def event(i: int, **kw) -> EventRecord:
    base = dict(time_s=1.5 * i, kind=EVENT_KINDS[i % len(EVENT_KINDS)], group="" if i % 2 else "fp8",
                replica=-1 if i % 2 else i, version=i, detail=json.dumps({"i": i}), duration_s=None if i % 2 else 3.0)
    base.update(kw)
    return EventRecord(**base)


RECORDS = {
    "trajectories": [traj(i) for i in range(12)],
    "updates": [update(v) for v in range(1, 6)],
    "groups": [group(v, g) for v in range(1, 4) for g in ("bf16", "fp8")],
    "events": [event(i) for i in range(len(EVENT_KINDS))],
}


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def expected_dtype_ok(table: str, df: pd.DataFrame) -> None:
    for f in fields(type(RECORDS[table][0])):
        col = df[f.name]
        if f.type == "int":
            assert col.dtype == "int64", (table, f.name, col.dtype)
        elif f.type == "float":
            assert col.dtype == "float64", (table, f.name, col.dtype)
        elif f.type == "str":
            assert pd.api.types.is_string_dtype(col.dtype), (table, f.name, col.dtype)
        else:
            assert col.dtype == object, (table, f.name, col.dtype)


def write_all(path: Path, **kw) -> RunLogWriter:
    w = RunLogWriter(path, {"source": "twin", "plan": {"groups": ["bf16", "fp8"]}, "seed": 7, "run_id": "r1"}, **kw)
    for t in TABLES:
        w.extend(RECORDS[t])
    return w


def test_round_trip_every_table(tmp_path: Path) -> None:
    d = tmp_path / "run"
    w = write_all(d)
    w.close()
    log = RunLog.open(d)
    assert log.header["source"] == "twin" and log.header["seed"] == 7 and log.header["run_id"] == "r1"
    assert log.header["plan"] == {"groups": ["bf16", "fp8"]} and log.header["status"] == "finished"
    assert "pandas" in log.header["versions"] and "created_utc" in log.header
    for t in TABLES:
        df = log.table(t)
        assert list(df.columns) == SCHEMAS[t].names
        assert len(df) == len(RECORDS[t])
        expected_dtype_ok(t, df)
        for rec, row in zip(RECORDS[t], df.to_dict("records"), strict=True):
            for k, v in asdict(rec).items():
                assert same(v, row[k]), (t, k, v, row[k])
    # None became NaN, ints stayed ints, the map came back as a dict
    assert math.isnan(log.updates["pass_at_k"].iloc[0]) and log.updates["pass_at_k"].iloc[1] == 0.5
    assert log.trajectories["tokens_by_version"].iloc[1] == {0: 11, 1: 41}
    assert log.trajectories["tokens_by_version"].iloc[0] is None


def test_empty_tables_have_columns(tmp_path: Path) -> None:
    d = tmp_path / "empty"
    RunLogWriter(d, {"source": "runner"}).close()
    log = RunLog.open(d)
    for t in TABLES:
        df = log.table(t)
        assert len(df) == 0 and list(df.columns) == SCHEMAS[t].names
        for f in fields(type(RECORDS[t][0])):
            if f.type in ("int", "float"):
                assert df[f.name].dtype == {"int": "int64", "float": "float64"}[f.type]
    assert log.header["status"] == "finished" and log.header["source"] == "runner"


def test_plain_pandas_and_pyarrow_read_tables_despite_temp_files(tmp_path: Path) -> None:
    d = tmp_path / "run"
    w = write_all(d, flush_every_rows=4)
    w.close()
    # a leftover temp file of a killed writer, named as the writer names them
    (d / "updates" / ".part-000009.parquet.deadbeef.tmp").write_bytes(b"PAR1 half a file")
    df = pd.read_parquet(d / "updates")
    assert sorted(df["version"]) == [1, 2, 3, 4, 5]
    assert pq.read_table(d / "trajectories").num_rows == len(RECORDS["trajectories"])
    parts = sorted(p.name for p in (d / "trajectories").iterdir() if not p.name.startswith("."))
    assert parts == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]


def test_garbage_and_truncated_parts_are_skipped_with_a_warning(tmp_path: Path) -> None:
    d = tmp_path / "run"
    w = RunLogWriter(d, {"source": "twin"})
    w.extend(update(v) for v in (1, 2))
    w.flush()
    w.append(update(3))
    w.flush()
    good = (d / "updates" / "part-000000.parquet").read_bytes()
    (d / "updates" / "part-000002.parquet").write_bytes(good[: len(good) // 2])  # truncated
    (d / "updates" / "part-000003.parquet").write_bytes(b"garbage")
    (d / "updates" / ".part-000004.parquet.0123abcd.tmp").write_bytes(good[:100])
    with pytest.warns(RunLogWarning, match="part-00000[23]"):
        log = RunLog.open(d)
    assert list(log.updates["version"]) == [1, 2, 3]
    assert sorted(p.name for p in log.skipped) == ["part-000002.parquet", "part-000003.parquet"]


def test_writer_killed_mid_run_reads_up_to_last_complete_part_and_resumes(tmp_path: Path) -> None:
    d = tmp_path / "killed"
    child = textwrap.dedent(f"""
        import sys
        from mixfleet.costmodel.records.runlog import RunLogWriter, TrajectoryRecord
        w = RunLogWriter({str(d)!r}, {{"source": "runner", "run_id": "k"}}, flush_every_rows=50, flush_every_s=None)
        i = 0
        while True:
            w.append(TrajectoryRecord(run_id="k", prompt_id=i, sample_index=0, group="g", replica=0,
                                      version_start=0, version_end=0, turns=1, prompt_tokens=1,
                                      generated_tokens=1, start_s=0.0, end_s=1.0, reward=0.0,
                                      finish_reason="done"))
            i += 1
            if i % 50 == 0:
                print(i, flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(4):
            assert proc.stdout.readline().strip()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunLogWarning)
        log = RunLog.open(d)
    n = len(log.trajectories)
    assert n >= 200 and n % 50 == 0
    assert list(log.trajectories["prompt_id"]) == [str(i) for i in range(n)]  # no gap, no duplicate
    assert log.header["status"] == "running"  # never closed
    # resume: numbering continues, old rows kept, temp files of the killed writer removed
    (d / "trajectories" / ".part-999999.parquet.0badf00d.tmp").write_bytes(b"x")
    w = RunLogWriter(d, {"source": "runner"})
    assert not any(p.name.endswith(".tmp") for p in (d / "trajectories").iterdir())
    w.append(traj(0, run_id="k", prompt_id=n))
    w.close()
    log = RunLog.open(d)
    assert list(log.trajectories["prompt_id"]) == [str(i) for i in range(n + 1)]
    assert log.header["resumes"] == 1 and log.header["status"] == "finished"
    assert (d / "trajectories" / f"part-{n // 50:06d}.parquet").exists()


def test_resume_continues_numbering_without_loss_or_duplicates(tmp_path: Path) -> None:
    d = tmp_path / "run"
    w = RunLogWriter(d, {"source": "twin", "run_id": "r9", "seed": 1})
    w.extend(update(v) for v in (1, 2))
    w.flush()
    w.append(update(3))
    w.close(status="failed")
    assert RunLog.open(d).header["status"] == "failed"
    w = RunLogWriter(d, {"source": "twin", "note": "resumed"})
    assert w.run_id == "r9" and w.header["seed"] == 1 and w.header["note"] == "resumed"
    w.extend(update(v) for v in (4, 5))
    w.close()
    names = sorted(p.name for p in (d / "updates").iterdir())
    assert names == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    log = RunLog.open(d)
    assert list(log.updates["version"]) == [1, 2, 3, 4, 5]
    assert log.header["resumes"] == 1 and log.header["status"] == "finished"
    with pytest.raises(SpecError, match="source"):
        RunLogWriter(d, {"source": "runner"})
    with pytest.raises(SpecError, match="run_id"):
        RunLogWriter(d, {"source": "twin", "run_id": "other"})


def test_truncate_after_version_for_a_checkpoint_resume(tmp_path: Path) -> None:
    d = tmp_path / "run"
    w = RunLogWriter(d, {"source": "runner"}, flush_every_rows=2, flush_every_s=None)
    w.extend(update(v) for v in range(1, 6))
    w.extend(group(v, "g") for v in range(1, 6))
    assert w.truncate_after_version(2) == 6
    w.extend(update(v) for v in (3, 4))
    w.close()
    log = RunLog.open(d)
    assert list(log.updates["version"]) == [1, 2, 3, 4]
    assert list(log.groups["version"]) == [1, 2]


def test_truncate_cuts_trajectories_by_the_update_that_trained_them(tmp_path: Path) -> None:
    """A resume replays the updates after the checkpoint: their trajectories go, untrained ones (-1) stay."""
    w = RunLogWriter(tmp_path / "run", {"source": "runner"}, flush_every_rows=3, flush_every_s=None)
    trained = [1, 2, 3, -1, 4, 2, -1, 3]
    w.extend(traj(i, trained_version=v, version_start=0, version_end=0) for i, v in enumerate(trained))
    assert w.truncate_after_version(2, tables=("trajectories",)) == 3
    w.close()
    assert sorted(RunLog.open(tmp_path / "run").trajectories["trained_version"]) == [-1, -1, 1, 2, 2]


def test_auto_flush_by_rows_and_refresh_follows_a_live_log(tmp_path: Path) -> None:
    d = tmp_path / "live"
    w = RunLogWriter(d, {"source": "twin"}, flush_every_rows=2, flush_every_s=None)
    w.extend(update(v) for v in range(1, 6))
    assert w.pending()["updates"] == 1
    log = RunLog.open(d)
    assert list(log.updates["version"]) == [1, 2, 3, 4]
    w.close()
    assert list(log.refresh().updates["version"]) == [1, 2, 3, 4, 5]
    assert log.header["status"] == "finished"


def test_update_header_is_atomic_and_validated(tmp_path: Path) -> None:
    d = tmp_path / "run"
    w = RunLogWriter(d, {"source": "twin", "extra_key": [1, 2]})
    w.update_header(status="finished", wall_s=1.25)
    h = json.loads((d / "run.json").read_text())
    assert h["status"] == "finished" and h["wall_s"] == 1.25 and h["extra_key"] == [1, 2]
    with pytest.raises(SpecError, match="'running', 'finished', 'stopped', 'failed'"):
        w.update_header(status="done")
    assert json.loads((d / "run.json").read_text())["status"] == "finished"
    assert [p.name for p in d.iterdir() if p.name.startswith(".")] == []


def test_context_manager_marks_failed_runs(tmp_path: Path) -> None:
    d = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with RunLogWriter(d, {"source": "runner"}) as w:
            w.append(update(1))
            raise RuntimeError("boom")
    log = RunLog.open(d)
    assert log.header["status"] == "failed" and list(log.updates["version"]) == [1]


def test_bad_values_are_refused_with_allowed_values(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="finish_reason.*'done', 'max_turns', 'no_tool_call_3x'"):
        traj(0, finish_reason="timeout")
    with pytest.raises(SpecError, match="kind.*'scale_up'.*'weight_push_failed'"):
        event(0, kind="explode")
    with pytest.raises(SpecError, match="source.*'twin', 'runner'"):
        RunLogWriter(tmp_path / "x", {"source": "sim"})
    with pytest.raises(SpecError, match="version_end"):
        traj(0, version_start=3, version_end=2)
    with pytest.raises(SpecError, match="tokens"):
        update(1, tokens=-1)
    with pytest.raises(SpecError, match="kl_k3"):
        update(1, kl_k3="high")
    with pytest.raises(SpecError, match="RunLog.open"):
        RunLog.open(tmp_path)
    w = RunLogWriter(tmp_path / "y", {"source": "twin"})
    with pytest.raises(SpecError, match="record"):
        w.append({"version": 1})  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="flush_every_rows"):
        RunLogWriter(tmp_path / "z", {"source": "twin"}, flush_every_rows=0)


def test_find_and_is_run_log(tmp_path: Path) -> None:
    for name in ("b/run2", "a/run1", "run0"):
        RunLogWriter(tmp_path / name, {"source": "twin"}).close()
    (tmp_path / "notalog").mkdir()
    (tmp_path / "notalog" / "run.json").write_text("{}")
    assert RunLog.is_run_log(tmp_path / "a" / "run1")
    assert not RunLog.is_run_log(tmp_path / "notalog") and not RunLog.is_run_log(tmp_path / "missing")
    assert RunLog.find(tmp_path) == [tmp_path / "a" / "run1", tmp_path / "b" / "run2", tmp_path / "run0"]
    assert RunLog.find(tmp_path / "run0") == [tmp_path / "run0"]


def test_a_part_with_another_schema_is_skipped_with_a_warning(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with RunLogWriter(log, {"source": "twin"}) as w:
        w.append(update(1))
        w.flush()
        w.append(update(2))
    pq.write_table(pa.table({"version": ["x", "y"], "foo": [1, 2]}), log / "updates" / "part-000007.parquet")
    pq.write_table(pa.table({"bar": [1.0]}), log / "updates" / "part-000008.parquet")
    with pytest.warns(RunLogWarning, match="part-00000[78]"):
        read = RunLog.open(log)
    assert list(read.updates.version) == [1, 2] and len(read.skipped) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RunLogWarning)
        w = RunLogWriter(log, {"source": "twin"})                      # a resume cuts around them, too
        assert w.truncate_after_version(1, tables=("updates",)) == 1
        w.close()
        assert list(RunLog.open(log).updates.version) == [1]


def test_a_corrupt_run_json_is_reported_as_corrupt(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "run.json").write_text('{"format": "mixfleet-runlog", ')
    assert "not valid JSON" in RunLog.not_a_run_log(bad) and RunLog.not_a_run_log(tmp_path) == "no run.json"
    res = runner.invoke(app, ["calibrate", str(bad)])
    assert res.exit_code == 2 and "not valid JSON" in res.output and "no run.json" not in res.output
    res = runner.invoke(app, ["fidelity", "--runlog", str(bad)])
    assert res.exit_code == 2 and "not valid JSON" in res.output


def test_finding_run_logs_is_bounded(tmp_path: Path) -> None:
    shallow = tmp_path / "study" / "mixed" / "grpo" / "seed0"
    deep = tmp_path.joinpath(*[f"d{i}" for i in range(9)])
    for d in (shallow, deep):
        RunLogWriter(d, {"source": "twin"}).close()
    assert RunLog.find(tmp_path) == [shallow]
    for i in range(30):
        (tmp_path / "many" / f"f{i:02d}").mkdir(parents=True)
    RunLogWriter(tmp_path / "many" / "f29" / "run", {"source": "twin"}).close()
    assert RunLog.find(tmp_path / "many", max_dirs=10) == []                 # stops looking after 10 folders
    assert RunLog.find(tmp_path / "many") == [tmp_path / "many" / "f29" / "run"]
    # issue 44: a link to a run folder elsewhere is not listed (the Runs page opened it; links are not followed)
    outside = tmp_path / "elsewhere" / "run"
    RunLogWriter(outside, {"source": "twin"}).close()
    (tmp_path / "many" / "linked").symlink_to(outside, target_is_directory=True)
    assert RunLog.find(tmp_path / "many") == [tmp_path / "many" / "f29" / "run"]
