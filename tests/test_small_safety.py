"""Issue 13's smaller faults: each bad input gets a clear error or is skipped with a warning, never a traceback,
a foreign file read, code run or an orphaned process.
(simulate --seed -1 / --out FILE are in tests/test_outdir.py.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import RunLog, RunLogWarning, RunLogWriter, UpdateRecord
from mixfleet.ui.cli import app
from typer.testing import CliRunner

runner = CliRunner()


def _update(v: int) -> UpdateRecord:
    return UpdateRecord(version=v, start_s=v, end_s=v + 1, train_step_s=1, weight_sync_s=0, tokens=1, trajectories=1,
                        staleness_mean=0, staleness_p50=0, staleness_p95=0, staleness_max=0, cost_sampler_usd=0,
                        cost_trainer_usd=0)


def test_a_binary_plan_file_is_a_one_line_error(tmp_path: Path) -> None:
    from mixfleet.policies.plan import load_plan

    plan = tmp_path / "plan.toml"
    plan.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(SpecError, match="binary data"):
        load_plan(plan)
    res = runner.invoke(app, ["simulate", str(plan), "-n", "1"])
    assert res.exit_code == 2 and "binary data" in res.output and not isinstance(res.exception, UnicodeDecodeError)


def test_a_part_with_another_schema_is_skipped_with_a_warning(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with RunLogWriter(log, {"source": "twin"}) as w:
        w.append(_update(1))
        w.flush()
        w.append(_update(2))
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


def test_an_uploaded_plan_base_is_a_shipped_name_or_a_file_beside_it(tmp_path: Path) -> None:
    from mixfleet.policies.plan import load_plan
    from mixfleet.ui.app_common import plan_from_upload

    secret = tmp_path / "elsewhere" / "secrets.toml"
    secret.parent.mkdir()
    secret.write_text('api_key = "SECRET-123"\n')
    for base in (str(secret), "../elsewhere/secrets.toml", "/etc/passwd"):
        with pytest.raises(SpecError, match="base") as err:
            plan_from_upload(f'base = "{base}"\nname = "x"\n'.encode())
        assert "SECRET-123" not in str(err.value) and "shipped" in str(err.value)
    assert plan_from_upload(b'base = "tiny-cpu"\nname = "mine"\n').name == "mine"
    own = tmp_path / "plans"
    own.mkdir()
    (own / "parent.toml").write_text('base = "tiny-cpu"\nname = "parent"\nseed = 5\n')
    (own / "child.toml").write_text('base = "parent.toml"\nname = "child"\n')
    assert load_plan(own / "child.toml").seed == 5
    os.symlink(secret, own / "link.toml")                      # a link out of the folder counts as outside
    (own / "sneaky.toml").write_text('base = "link.toml"\nname = "s"\n')
    with pytest.raises(SpecError, match="base"):
        load_plan(own / "sneaky.toml")


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


def test_trainer_state_loads_tensors_only(tmp_path: Path) -> None:
    """A trainer_state.pt that would run code when unpickled is refused, and its code does not run."""
    import json

    from mixfleet.runner.trainer.trainer import META_FILE, STATE_FILE, STATE_FORMAT, Trainer

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (os.system, (f"touch {marker}",))

    state = tmp_path / "state"
    state.mkdir()
    import torch

    torch.save({"format": STATE_FORMAT, "model": Evil()}, state / STATE_FILE)   # the real file format
    from mixfleet.costmodel.specs.model import load_model_spec

    spec = load_model_spec("tiny").to_dict()
    (state / META_FILE).write_text(json.dumps({"format": STATE_FORMAT, "version": 1, "spec": spec, "config": {}}))
    with pytest.raises(ValueError, match="tensors and plain values"):
        Trainer.resume(state)
    assert not marker.exists()


@pytest.mark.slow
def test_sigterm_to_mixfleet_ui_stops_the_streamlit_child(tmp_path: Path) -> None:
    from mixfleet.ui.commands.webapp import free_port

    exe = Path(sys.executable).with_name("mixfleet")
    ui = subprocess.Popen([str(exe), "ui", "--port", str(free_port()), "--runs-dir", str(tmp_path)],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    child = None
    try:
        for _ in range(900):                                 # a loaded machine: up to 90 s
            kids = [k for k in psutil.Process(ui.pid).children() if "streamlit" in " ".join(k.cmdline())]
            if kids:                                          # (a child caught before its exec looks like us)
                child = kids[0]
                break
            time.sleep(0.1)
        assert child is not None and "streamlit" in " ".join(child.cmdline())
        time.sleep(3.0)                                       # let it start serving
        ui.send_signal(signal.SIGTERM)
        ui.wait(timeout=90)
        _, alive = psutil.wait_procs([child], timeout=60)
        assert alive == [], "the Streamlit child outlived `mixfleet ui`"
    finally:
        if ui.poll() is None:
            ui.kill()
        if child is not None and child.is_running():            # only what this test started
            child.kill()
