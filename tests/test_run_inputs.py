"""Issue 24 (second probe), the run-folder and flag cases that need no training run: each is refused with one
line naming the flag or field, before anything starts, and nothing on disk is lost.

- `--out FILE/sub`, a symlinked `--out` with `--force`: one-line errors (tracebacks before);
- `--force` replaces only mixfleet's own temp names: a user's `.draft.old.1` is kept (it was deleted), while a
  killed trainer save's `.trainer_state.<random>` no longer blocks `--resume` / `--force`;
- one writer per run folder: a second writer is refused naming the first one's pid (`lock_output_dir`);
- a resumed run log refuses another plan (`RunLogWriter`'s own check);
- `--kill-at cpu-bf16@abc`, `[embedded] task = "chess"`: refused naming the flag / field
  (`--kv-budget 0` of capacity / catalog is in tests/test_limits.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.outdir import classify, prepare_output_dir
from mixfleet.costmodel.records.runlog import RunLog, RunLogWriter, UpdateRecord
from mixfleet.ui.cli import app
from runplans import CPU_BF16, run_files, run_plan_toml
from typer.testing import CliRunner

runner = CliRunner()
PLAN = "data/plans/tiny-cpu.toml"
ROOT = Path(__file__).resolve().parents[1]


def _runner_log(d: Path, plan: dict | None = None) -> Path:
    """A run folder as `mixfleet run` leaves it after one update (run log + trainer state files)."""
    with RunLogWriter(d, {"source": "runner", "plan": plan or {"name": "p"}}) as w:
        w.append(UpdateRecord(version=1, start_s=0, end_s=1, train_step_s=1, weight_sync_s=0, tokens=1,
                              trajectories=1, staleness_mean=0, staleness_p50=0, staleness_p95=0, staleness_max=0,
                              cost_sampler_usd=0, cost_trainer_usd=0))
    (d / "trainer_state").mkdir()
    (d / "trainer_state" / "trainer_meta.json").write_text('{"version": 1}')
    (d / "trainer_state" / "trainer_state.pt").write_bytes(b"state")
    return d


def _one_line_error(res, *needles: str) -> str:  # noqa: ANN001
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert isinstance(res.exception, SystemExit), res.exception          # a message, not a traceback
    assert "Traceback" not in res.output
    errors = [ln for ln in res.output.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1, res.output
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def test_out_under_a_file_is_one_line_error(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    res = runner.invoke(app, ["run", PLAN, "--out", str(f / "sub"), "--init", str(tmp_path / "x"), "--updates", "1"])
    _one_line_error(res, "--out", str(f), "not a folder")
    assert f.read_text() == "mine"


def test_force_refuses_a_symlinked_out_and_keeps_the_run_it_points_to(tmp_path: Path) -> None:
    real = _runner_log(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(real)
    res = runner.invoke(app, ["run", PLAN, "--out", str(link), "--force", "--init", str(tmp_path / "x"),
                              "--updates", "1"])
    _one_line_error(res, "--out", "symbolic link", str(real))
    assert list(RunLog.open(real).updates.version) == [1] and (real / "trainer_state" / "trainer_state.pt").exists()
    with pytest.raises(SpecError, match="symbolic link"):
        prepare_output_dir(link, "run", where="t", force=True)
    assert link.is_symlink() and (real / "run.json").exists()


def test_force_keeps_a_users_draft_old_file(tmp_path: Path) -> None:
    """`.draft.old.1` looked like an atomic writer's leftover (any `.X.old.N`), so --force deleted it."""
    run = _runner_log(tmp_path / "run")
    (run / ".draft.old.1").write_text("my draft")
    assert classify(run) is None
    res = runner.invoke(app, ["run", PLAN, "--out", str(run), "--force", "--init", str(tmp_path / "x"),
                              "--updates", "1"])
    _one_line_error(res, "did not write", ".draft.old.1")
    assert (run / ".draft.old.1").read_text() == "my draft" and (run / "run.json").exists()


def test_our_own_temp_names_do_not_block_resume_or_force_but_lookalikes_do(tmp_path: Path) -> None:
    """What a kill leaves: `.trainer_state.<mkdtemp>` (Trainer.save_state), `.trainer_state.old.<pid>`
    (replace_dir_atomically), the checkpoint staging folder and its own temp. They made --resume and --force
    refuse with "holds files mixfleet did not write"; a folder of that name holding other files is the user's."""
    run = _runner_log(tmp_path / "run")
    cut = run / ".trainer_state.k3j_a9zq"                   # killed while torch.save wrote the state
    cut.mkdir()
    (cut / "trainer_state.pt").write_bytes(b"\x80\x02half a pickle")
    (run / ".trainer_state.old.4242").mkdir()
    (run / ".trainer_state.old.4242" / "trainer_meta.json").write_text("{}")
    (run / ".trainer_state.next").mkdir()
    (run / "..trainer_state.next.ab_c1234").mkdir()
    assert classify(run) == "run"
    assert prepare_output_dir(run, "run", where="t", resume=True) == "resume"
    assert prepare_output_dir(run, "run", where="t", force=True, clear=False) == "replace"
    # new in this fix (imported here, so that on the old code the test fails, not the module's collection)
    from mixfleet.costmodel.records.outdir import LOCK_FILE, lock_output_dir

    mine = run / ".trainer_state.mybackup"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert classify(run) is None
    with pytest.raises(SpecError, match=r"did not write \(.trainer_state.mybackup\)"):
        prepare_output_dir(run, "run", where="t", force=True)
    assert (mine / "notes.txt").exists()
    (mine / "notes.txt").unlink()
    mine.rmdir()
    with lock_output_dir(run, where="t"):
        assert prepare_output_dir(run, "run", where="t", force=True) == "replace"
        assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE]     # cleared; still ours, still locked


_HOLDER = """
import sys, time
from mixfleet.costmodel.records.outdir import lock_output_dir
lock = lock_output_dir(sys.argv[1], where="holder")
print("held", flush=True)
time.sleep(600)
"""
_TRY = """
import sys
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.outdir import lock_output_dir
try:
    lock_output_dir(sys.argv[1], where="try")
    print("taken")
except SpecError as e:
    print("refused:", e)
"""


def _other_process_can_lock(folder: Path) -> bool:
    out = subprocess.run([sys.executable, "-c", _TRY, str(folder)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.startswith("taken")


def test_a_second_writer_is_refused_naming_the_pid_that_holds_the_folder(tmp_path: Path) -> None:
    from mixfleet.costmodel.records.outdir import lock_output_dir

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SpecError, match=rf"pid {holder.pid} holds its lock"):
            lock_output_dir(out, where="mixfleet run")
        res = runner.invoke(app, ["run", PLAN, "--out", str(out), "--init", str(tmp_path / "x"), "--updates", "1"])
        _one_line_error(res, "--out", f"pid {holder.pid}")
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(30)
    lock = lock_output_dir(out, where="t")                       # a killed holder releases it
    again = lock_output_dir(out, where="t")                      # re-entrant in one process
    lock.release()
    assert not _other_process_can_lock(out)
    again.release()
    assert _other_process_can_lock(out)


def test_a_reopened_run_log_refuses_another_plan(tmp_path: Path) -> None:
    plan = {"name": "p", "groups": [{"name": "a", "replicas": 1}, {"name": "b", "replicas": 1}],
            "policies": {"router": {"name": "capacity_proportional"}}}
    RunLogWriter(tmp_path / "log", {"source": "runner", "plan": plan}).close("stopped")
    other = {**plan, "policies": {"router": {"name": "least_outstanding_tokens"}}}
    with pytest.raises(SpecError, match=r"policies.router.name: 'capacity_proportional' -> 'least_outstanding_tokens'"):
        RunLogWriter(tmp_path / "log", {"source": "runner", "plan": other})
    assert RunLog.open(tmp_path / "log").header["plan"] == plan
    reordered = {**plan, "groups": plan["groups"][::-1], "description": "same plan, other words"}
    RunLogWriter(tmp_path / "log", {"source": "runner", "plan": reordered}).close("stopped")
    assert RunLog.open(tmp_path / "log").header["resumes"] == 1


def test_kill_at_errors_name_the_flag(tmp_path: Path) -> None:
    for item, why in (("cpu-bf16@abc", "UPDATE an integer in 1..2"), ("cpu-bf16@0", "UPDATE an integer in 1..2"),
                      ("nope@1", "GROUP one of the plan's groups (cpu-bf16, cpu-fp8, cpu-nvfp4)"),
                      ("cpu-bf16", "GROUP@UPDATE")):
        res = runner.invoke(app, ["run", PLAN, "--out", str(tmp_path / "out"), "--init", str(tmp_path / "x"),
                                  "--updates", "2", "--kill-at", item])
        _one_line_error(res, "--kill-at", repr(item), why)
    assert not (tmp_path / "out").exists()


def test_an_unknown_task_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Before: `[embedded] task = "chess"` passed every check and failed once Ray and the samplers were up."""
    plan_toml = run_plan_toml("chess", [CPU_BF16], embedded={"task": "chess", "max_turns": 2, "max_new_tokens": 8},
                              batcher={"prompts_per_update": 2, "samples_per_prompt": 2})
    init, plan = run_files(tmp_path, plan_toml)
    out = tmp_path / "out"
    t0 = time.monotonic()
    child = subprocess.run([sys.executable, "-m", "mixfleet.ui.cli", "run", str(plan), "--out", str(out), "--init",
                            str(init), "--updates", "1", "--quiet"], capture_output=True, text=True, timeout=600,
                           cwd=ROOT)
    took = time.monotonic() - t0
    assert child.returncode == 2, (child.returncode, child.stdout[-2000:], child.stderr[-2000:])
    err = [ln for ln in child.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and "embedded: field 'task' = 'chess'" in err[0] and "'calc', 'guess'" in err[0], child.stderr
    assert not out.exists() and took < 120, took                    # no run folder, no Ray, no sampler
    res = runner.invoke(app, ["run", str(plan), "--out", str(out), "--init", str(init), "--task", "chess2"])
    _one_line_error(res, "embedded: field 'task' = 'chess2'")          # --task chess2: embedded.task = chess2
