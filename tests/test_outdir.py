"""Existing output is never silently destroyed or mixed (costmodel/records/outdir.py, used by every command writing a
folder).

A non-empty destination that is not the same kind is refused with a message naming --resume / --force; --force
replaces only what mixfleet wrote; a user's folder survives every command, --force or not.
"""

from __future__ import annotations

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


def _runner_log(d: Path) -> Path:
    with RunLogWriter(d, {"source": "runner", "plan": {"name": "p"}}) as w:
        w.append(UpdateRecord(version=1, start_s=0, end_s=1, train_step_s=1, weight_sync_s=0, tokens=1,
                              trajectories=1, staleness_mean=0, staleness_p50=0, staleness_p95=0, staleness_max=0,
                              cost_sampler_usd=0, cost_trainer_usd=0))
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
