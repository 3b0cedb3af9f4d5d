"""Existing output is never silently destroyed or mixed (costmodel/records/outdir.py, used by every command writing a
folder).

A non-empty destination that is not the same kind is refused with a message naming --resume / --force; --force
replaces only what mixfleet wrote; a user's folder survives every command, --force or not.

Nothing of a run log is lost to a writer (issue 44, third probe): `evaluate --out` refuses an existing file
without --force and never writes into a run folder; `simulate` locks its --out as `run` does; `export` never
writes into any run log's folders.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.outdir import classify, prepare_output_dir
from mixfleet.costmodel.records.runlog import RunLog, RunLogWriter, UpdateRecord
from mixfleet.ui.cli import app
from typer.testing import CliRunner

runner = CliRunner()


def _user_folder(tmp_path: Path) -> Path:
    d = tmp_path / "mine"
    d.mkdir()
    (d / "thesis.tex").write_text("years of work")
    return d


def _run_log(d: Path, source: str = "runner") -> Path:
    with RunLogWriter(d, {"source": source, "plan": {"name": "p"}}) as w:
        w.append(UpdateRecord(version=1, start_s=0, end_s=1, train_step_s=1, weight_sync_s=0, tokens=1,
                              trajectories=1, staleness_mean=0, staleness_p50=0, staleness_p95=0, staleness_max=0,
                              cost_sampler_usd=0, cost_trainer_usd=0))
    return d


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _runner_log(d: Path) -> Path:
    _run_log(d)
    (d / "trainer_state").mkdir()
    return d


def test_init_model_keeps_a_users_folder_and_replaces_a_checkpoint_only_with_force(tmp_path: Path) -> None:
    mine = _user_folder(tmp_path)
    for extra in ([], ["--force"]):
        res = runner.invoke(app, ["init-model", "tiny", "-o", str(mine), *extra])
        assert res.exit_code == 2, res.output
        assert "mixfleet did not write" in res.output and "thesis.tex" in res.output
        assert (mine / "thesis.tex").read_text() == "years of work" and sorted(p.name for p in mine.iterdir()) == \
            ["thesis.tex"]
    ck = tmp_path / "ck"
    assert runner.invoke(app, ["init-model", "tiny", "-o", str(ck), "--seed", "0"]).exit_code == 0
    before = (ck / "model.safetensors").read_bytes()
    again = runner.invoke(app, ["init-model", "tiny", "-o", str(ck), "--seed", "1"])
    assert again.exit_code == 2 and "--force" in again.output and "checkpoint" in again.output
    assert (ck / "model.safetensors").read_bytes() == before
    forced = runner.invoke(app, ["init-model", "tiny", "-o", str(ck), "--seed", "1", "--force"])
    assert forced.exit_code == 0, forced.output
    assert (ck / "model.safetensors").read_bytes() != before


def test_simulate_refuses_to_append_a_second_run_to_a_run_log(tmp_path: Path) -> None:
    log = tmp_path / "log"
    assert runner.invoke(app, ["simulate", "tiny-cpu", "-n", "2", "--out", str(log), "--json"]).exit_code == 0
    first = RunLog.open(log)
    res = runner.invoke(app, ["simulate", "tiny-cpu", "-n", "2", "--out", str(log), "--json"])
    assert res.exit_code == 2 and "--force" in res.output and "twin run log" in res.output
    same = RunLog.open(log)
    assert same.run_id == first.run_id and list(same.updates.version) == [1, 2]
    forced = runner.invoke(app, ["simulate", "tiny-cpu", "-n", "2", "--out", str(log), "--json", "--force"])
    assert forced.exit_code == 0, forced.output
    new = RunLog.open(log)
    assert new.run_id != first.run_id and list(new.updates.version) == [1, 2] and new.header["resumes"] == 0
    mine = _user_folder(tmp_path)
    res = runner.invoke(app, ["simulate", "tiny-cpu", "-n", "1", "--out", str(mine), "--force"])
    assert res.exit_code == 2 and (mine / "thesis.tex").exists()


def test_simulate_bad_out_and_seed_are_one_line_errors(tmp_path: Path) -> None:
    f = tmp_path / "passwd"
    f.write_text("root:x:0:0\n")
    res = runner.invoke(app, ["simulate", "tiny-cpu", "-n", "1", "--out", str(f)])
    assert res.exit_code == 2 and "is a file" in res.output
    assert f.read_text() == "root:x:0:0\n"
    neg = runner.invoke(app, ["simulate", "tiny-cpu", "-n", "1", "--seed", "-1"])
    assert neg.exit_code == 2 and "--seed" in neg.output and not isinstance(neg.exception, ValueError)
    from mixfleet.twin.sim import simulate

    with pytest.raises(SpecError, match="seed"):
        simulate("tiny-cpu", updates=1, seed=-1)


def test_run_refuses_an_existing_run_without_resume_or_force(tmp_path: Path) -> None:
    """Checked before anything starts (no pretrain, no Ray): the message names --resume and --force."""
    run = _runner_log(tmp_path / "run")
    res = runner.invoke(app, ["run", "data/plans/tiny-cpu.toml", "--out", str(run), "--init", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--resume" in res.output and "--force" in res.output, res.output
    assert list(RunLog.open(run).updates.version) == [1]
    sim = tmp_path / "sim"
    assert runner.invoke(app, ["simulate", "tiny-cpu", "-n", "1", "--out", str(sim)]).exit_code == 0
    res = runner.invoke(app, ["run", "data/plans/tiny-cpu.toml", "--out", str(sim), "--resume"])
    assert res.exit_code == 2 and "twin run log" in res.output
    mine = _user_folder(tmp_path)
    res = runner.invoke(app, ["run", "data/plans/tiny-cpu.toml", "--out", str(mine), "--force"])
    assert res.exit_code == 2 and (mine / "thesis.tex").exists()


def test_the_helper_decides_new_resume_replace(tmp_path: Path) -> None:
    assert prepare_output_dir(tmp_path / "absent", "run", where="t") == "new"
    (tmp_path / "empty").mkdir()
    assert prepare_output_dir(tmp_path / "empty", "run", where="t") == "new"
    run = _runner_log(tmp_path / "run")
    (run / ".run.json.0123abcd.tmp").write_text("")          # a killed writer's temp file is still ours
    assert classify(run) == "run"
    assert prepare_output_dir(run, "run", where="t", resume=True) == "resume"
    with pytest.raises(SpecError, match="--resume"):
        prepare_output_dir(run, "twin_runlog", where="t", resume=True)
    assert prepare_output_dir(run, "run", where="t", force=True) == "replace" and not run.exists()
    # a run.json of another format, or one foreign file beside ours, makes the folder not ours
    other = tmp_path / "other"
    other.mkdir()
    (other / "run.json").write_text('{"format": "someone-elses"}')
    assert classify(other) is None
    run2 = _runner_log(tmp_path / "run2")
    (run2 / "notes.md").write_text("mine")
    assert classify(run2) is None
    with pytest.raises(SpecError, match="did not write"):
        prepare_output_dir(run2, "run", where="t", force=True)
    assert (run2 / "notes.md").exists() and (run2 / "run.json").exists()


def test_evaluate_out_refuses_an_existing_file_and_any_run_folder(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    assert runner.invoke(app, ["init-model", "tiny", "-o", str(ck), "--seed", "0"]).exit_code == 0
    run = _run_log(tmp_path / "runs" / "a")
    before = _tree(run)
    mine = tmp_path / "notes.json"
    mine.write_text("years of work")
    ev = ["evaluate", str(ck), "--problems", "1", "--k", "1", "--json"]
    res = runner.invoke(app, [*ev, "--out", str(mine)])
    assert res.exit_code == 2 and "--force" in res.output and "already exists" in res.output, res.output
    assert mine.read_text() == "years of work"
    for target in (run / "run.json", run / "eval.json", run / "updates" / "x.json"):      # with --force too
        res = runner.invoke(app, [*ev, "--out", str(target), "--force"])
        assert res.exit_code == 2 and f"{run} is a run log" in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1 and str(tmp_path / "runs" / "a-") in res.output
    assert _tree(run) == before and RunLog.open(run).run_id
    res = runner.invoke(app, [*ev, "--out", str(mine / "sub")])
    assert res.exit_code == 2 and "not a folder" in res.output
    res = runner.invoke(app, [*ev, "--out", str(mine), "--force"])
    assert res.exit_code == 0, res.output
    assert json.loads(mine.read_text())["settings"]["problems"] == 1


_HOLD = ("import sys, time\nfrom mixfleet.costmodel.records.outdir import lock_output_dir\n"
         "lock_output_dir(sys.argv[1], where='mixfleet run')\nprint('held', flush=True)\ntime.sleep(120)\n")


def _simulate(out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "mixfleet.ui.cli", "simulate", "tiny-cpu", "-n", "30", "--out",
                             str(out), "--json", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_simulate_locks_its_out_as_run_does(tmp_path: Path) -> None:
    """Another writer holds the folder (a run's lock, taken by another process): simulate, with --force or not, is
    refused naming its pid and writes nothing. Two simulates started together into one new --out: one log, each
    version once."""
    out = tmp_path / "log"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        for extra in ((), ("--force",)):
            p = _simulate(out, *extra)
            _, err = p.communicate(timeout=300)
            assert p.returncode == 2, err
            assert f"mixfleet pid {holder.pid} holds its lock" in err and len(err.strip().splitlines()) == 1, err
            assert sorted(x.name for x in out.iterdir()) == [".mixfleet.lock"]
    finally:
        holder.kill()
        holder.wait()
    both = tmp_path / "both"
    a, b = _simulate(both), _simulate(both)
    codes = sorted((a.wait(timeout=300), b.wait(timeout=300)))
    assert codes == [0, 2], codes
    versions = list(RunLog.open(both).updates.version)
    assert versions == list(range(1, 31))
    assert runner.invoke(app, ["simulate", "tiny-cpu", "-n", "2", "--out", str(both), "--force"]).exit_code == 0


def test_export_never_writes_under_a_file_or_into_any_run_log(tmp_path: Path) -> None:
    a, other = _run_log(tmp_path / "a", "twin"), _run_log(tmp_path / "other", "runner")
    before = _tree(other)
    f = tmp_path / "notes.txt"
    f.write_text("x")
    res = runner.invoke(app, ["export", str(a), "--to", "tensorboard", "--out", str(f / "sub")])
    assert res.exit_code == 2 and "not a folder" in res.output and len(res.output.strip().splitlines()) == 1, \
        res.output
    assert not isinstance(res.exception, NotADirectoryError)
    for dest in (other / "updates", other / "events" / "tb", other):
        res = runner.invoke(app, ["export", str(a), "--to", "tensorboard", "--out", str(dest)])
        assert res.exit_code == 2 and str(other) in res.output and "run log" in res.output, res.output
    assert _tree(other) == before and len(RunLog.open(other).updates) == 1
    ok = runner.invoke(app, ["export", str(a), "--to", "tensorboard", "--out", str(tmp_path / "tb" / "a")])
    assert ok.exit_code == 0, ok.output


def test_run_tracker_under_a_file_is_refused_before_the_run_starts(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("x")
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", "tiny-cpu", "--out", str(out), "--updates", "1",
                              "--tracker", f"tensorboard={f / 'sub'}"])
    assert res.exit_code == 2 and "--tracker" in res.output and "not a folder" in res.output, res.output
    assert not out.exists()
    other = _run_log(tmp_path / "other")
    res = runner.invoke(app, ["run", "tiny-cpu", "--out", str(out), "--updates", "1",
                              "--tracker", f"tensorboard={other / 'groups'}"])
    assert res.exit_code == 2 and f"{other} is a run log" in res.output and not out.exists(), res.output
