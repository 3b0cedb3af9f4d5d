"""Issue 24 (second probe), the resume cases, on real runs (tiny model, one CPU sampler group, Ray actors,
Megatron-core trainer): one run of 2 updates (tests/run_child.py, as tests/test_run_resume.py does), copied
and altered per test to what a kill or a user leaves, then `mixfleet run ... --resume` as the probe ran it.

- BAD 1: a kill between `replace_dir_atomically`'s two renames leaves `.trainer_state.old.<pid>` beside no
  `trainer_state/` (the probe: `mv R/trainer_state R/.trainer_state.old.1`). --resume deleted run.json and
  every table and trained from the base policy again. Now it puts the old state back and continues; with no
  state at all it refuses and keeps the log; a log with no update yet continues from the base in that log.
- A kill during `Trainer.save_state` leaves `.trainer_state.<random>`: --resume refused ("holds files mixfleet
  did not write"); now it is recognized and removed.
- BAD 2: --resume with another plan replaced the log's plan; now refused (the resolved plans are compared),
  naming each differing field with the saved and the new value; a differing run setting (embedded.*) is taken
  only with --take-new-settings, which the run log records (issue 43).
- A corrupt orchestrator.json is named with what is wrong; a trainer state the trainer refuses is one line,
  not a 90-line ActorDiedError; a second writer on one new --out is refused naming the first one's pid.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.policies.plan import load_plan
from runplans import CPU_BF16, run_plan_toml
from test_run_resume import PLAN, PPU, RUN_TIMEOUT_S, _check_log, _run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# the same plan name, other content: what must be compared is the plan, not its name or file name
OTHER_PLAN = run_plan_toml(
    "test-resume", [CPU_BF16], embedded={"max_turns": 2, "max_new_tokens": 8},
    batcher={"prompts_per_update": PPU, "samples_per_prompt": 2, "inflight_prompts": 6, "max_staleness": 0,
             "stale": "wait"})


@pytest.fixture(scope="module", autouse=True)
def _no_ray_memory_monitor() -> Any:
    """Ray kills a worker when the *machine* is at 95% memory; on this shared machine that is other people's
    tests (it failed the first run here twice, a sampler 'cannot start'). The children's Rays run without it."""
    old = os.environ.get("RAY_memory_monitor_refresh_ms")
    os.environ["RAY_memory_monitor_refresh_ms"] = "0"
    yield
    if old is None:
        os.environ.pop("RAY_memory_monitor_refresh_ms", None)
    else:
        os.environ["RAY_memory_monitor_refresh_ms"] = old


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from runplans import run_files

    root = tmp_path_factory.mktemp("probe2-resume")
    init, plan = run_files(root, PLAN)
    out = root / "first"
    code, lines = _run([str(plan), str(out), str(init), "2"], root, "first")
    assert code == 0 and lines[-1].startswith("UPDATE 2"), (lines, (root / "first.err").read_text()[-2000:])
    return {"root": root, "init": init, "plan": plan, "out": out}


def _copy(first_run: dict[str, Path], tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(first_run["out"], out, symlinks=True)
    return out


def _cli(argv: list[str], timeout_s: float = RUN_TIMEOUT_S) -> tuple[int | None, str, str]:
    """`mixfleet run ARGV` as a child (its own session, killed whole at the timeout): (code or None, out, err)."""
    cmd = [sys.executable, "-m", "mixfleet.ui.cli", "run", *argv, "--quiet", "--eval-every", "0",
           "--trainer-threads", "1"]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                             start_new_session=True)
    try:
        out, err = child.communicate(timeout=timeout_s)
        return child.returncode, out, err
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        out, err = child.communicate(timeout=60)
        return None, out, err


def _resume(first_run: dict[str, Path], out: Path, updates: int, plan: Path | None = None) -> list[str]:
    return [str(plan or first_run["plan"]), "--out", str(out), "--init", str(first_run["init"]), "--updates",
            str(updates), "--resume"]


def _log_bytes(out: Path, header: bool = True) -> dict[str, bytes]:
    """The run log as it is on disk: run.json (if `header`) and every part file of every table."""
    files = sorted(p for t in ("updates", "groups", "trajectories", "events") for p in (out / t).glob("part-*"))
    return {str(p.relative_to(out)): p.read_bytes() for p in ([out / "run.json"] if header else []) + files}


def _error_line(err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error:"), err[-3000:]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def test_resume_puts_back_the_trainer_state_a_killed_replace_set_aside(first_run: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    out = _copy(first_run, tmp_path)
    before = RunLog.open(out)
    os.rename(out / "trainer_state", out / ".trainer_state.old.1")        # the probe's reproduction
    code, so, se = _cli(_resume(first_run, out, 3))
    assert code == 0, (code, so[-1500:], se[-3000:])
    log = RunLog.open(out)
    assert log.run_id == before.run_id                                    # the same log, continued
    _check_log(out, 3, resumes=1)
    resume = log.events[log.events["kind"] == "resume"]
    assert resume["version"].tolist() == [2], resume                      # from the checkpoint of update 2
    assert "restored trainer_state from .trainer_state.old.1" in json.loads(resume["detail"].iloc[0])["recovered"]
    old = before.updates.sort_values("version")[["version", "end_s", "loss"]].reset_index(drop=True)
    kept = log.updates[log.updates["version"] <= 2].sort_values("version")[["version", "end_s", "loss"]]
    assert kept.reset_index(drop=True).equals(old)                        # its first two updates untouched
    assert json.loads((out / "trainer_state" / "trainer_meta.json").read_text())["version"] == 3
    assert not (out / ".trainer_state.old.1").exists()


def test_resume_removes_what_a_kill_during_the_trainers_save_left(first_run: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    out = _copy(first_run, tmp_path)
    cut = out / ".trainer_state.k3j_a9zq"              # Trainer.save_state's mkdtemp, killed inside torch.save
    cut.mkdir()
    state = (out / "trainer_state" / "trainer_state.pt").read_bytes()
    (cut / "trainer_state.pt").write_bytes(state[: len(state) // 2])
    code, so, se = _cli(_resume(first_run, out, 2))
    assert code == 0, (code, so[-1500:], se[-3000:])
    _check_log(out, 2, resumes=1)
    assert not cut.exists()
    detail = json.loads(RunLog.open(out).events.query("kind == 'resume'")["detail"].iloc[0])
    assert "removed unfinished .trainer_state.k3j_a9zq" in detail["recovered"]


def test_resume_without_any_trainer_state_refuses_and_keeps_the_log(first_run: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    out = _copy(first_run, tmp_path)
    shutil.rmtree(out / "trainer_state")
    log_before = _log_bytes(out)
    code, so, se = _cli(_resume(first_run, out, 3))
    assert code == 2, (code, so[-1500:], se[-3000:])
    _error_line(se, "trainer_state is missing", "updates 1..2", "nothing was changed", "--force")
    assert _log_bytes(out) == log_before


def test_a_log_killed_before_its_first_checkpoint_continues_from_the_base_in_the_same_log(
        first_run: dict[str, Path], tmp_path: Path) -> None:
    """No trainer state and no update yet: continue from the base policy, keeping what the log holds (it
    started a fresh log, deleting the old one)."""
    out = _copy(first_run, tmp_path)
    shutil.rmtree(out / "trainer_state")
    for table in ("updates", "groups"):                # as a run killed before its first update had them
        for part in (out / table).glob("part-*"):
            part.unlink()
    for part in (out / "trajectories").glob("part-*"):
        data = pq.read_table(part)
        keep = [i for i, v in enumerate(data.column("trained_version").to_pylist()) if v <= 0]
        pq.write_table(data.take(keep), part) if keep else part.unlink()
    before = RunLog.open(out)
    code, so, se = _cli(_resume(first_run, out, 1))
    assert code == 0, (code, so[-1500:], se[-3000:])
    log = RunLog.open(out)
    assert log.run_id == before.run_id and log.header["resumes"] == 1
    assert log.updates["version"].tolist() == [1]
    first_events = before.events[["time_s", "kind"]].reset_index(drop=True)
    assert log.events[["time_s", "kind"]].head(len(first_events)).reset_index(drop=True).equals(first_events)
    resume = log.events[log.events["kind"] == "resume"]
    assert resume["version"].tolist() == [0] and resume["time_s"].min() >= first_events["time_s"].max()
    assert "continues from the base policy" in resume["detail"].iloc[0]
    assert not log.trajectories.duplicated(["prompt_id", "sample_index"]).any()     # prompt ids go on


def test_resume_with_another_plan_is_refused(first_run: dict[str, Path], tmp_path: Path) -> None:
    out = _copy(first_run, tmp_path)
    other = tmp_path / "tiny-cpu.toml"                  # another plan (under the same plan name)
    other.write_text(OTHER_PLAN)
    log_before = _log_bytes(out)
    code, so, se = _cli(_resume(first_run, out, 3, plan=other))
    assert code == 2, (code, so[-1500:], se[-3000:])
    _error_line(se, "policies.batcher.inflight_prompts", "'test-resume'",
                "differs in 1 field(s): policies.batcher.inflight_prompts: saved 8, now 6")
    assert _log_bytes(out) == log_before
    # the same plan in another file passes the check: the resolved plans are compared, not the file names
    from mixfleet.runner.orchestration.resume import prepare_resume

    same = tmp_path / "renamed.toml"
    same.write_text(first_run["plan"].read_text())
    point = prepare_resume(out, load_plan(same), apply=False)
    assert point is not None and point.version == 2 and point.from_state


def test_a_resume_with_another_setting_is_refused_naming_both_or_takes_it_when_asked(
        first_run: dict[str, Path], tmp_path: Path) -> None:
    """Issue 43: on resume the trainer's saved learning rate silently won over the plan's. Now a run setting that
    differs from the saved run's is refused naming the field, the saved and the new value; `--take-new-settings`
    takes it (the trainer trains with it, run.json's plan says it, a `new_settings` event records both values);
    a setting that would make another run (the base policy's pretraining) is refused even then."""
    out = _copy(first_run, tmp_path)
    log_before = _log_bytes(out)
    lower = ["--set", "embedded.lr=5e-5"]
    code, so, se = _cli([*_resume(first_run, out, 3), *lower])
    assert code == 2, (code, so[-1500:], se[-3000:])
    _error_line(se, "embedded.lr", "saved 0.0001, now 5e-05", "--take-new-settings")
    assert _log_bytes(out) == log_before
    code, so, se = _cli([*_resume(first_run, out, 3), "--set", "embedded.base_steps=10", "--take-new-settings"])
    assert code == 2, (code, so[-1500:], se[-3000:])
    line = _error_line(se, "embedded.base_steps", "saved 0, now 10")
    assert "--take-new-settings (" not in line                          # not offered: it cannot be taken
    assert _log_bytes(out) == log_before
    code, so, se = _cli([*_resume(first_run, out, 3), *lower, "--take-new-settings"])
    assert code == 0, (code, so[-1500:], se[-3000:])
    _check_log(out, 3, resumes=1)
    log = RunLog.open(out)
    taken = log.events[log.events["kind"] == "new_settings"]
    assert taken["version"].tolist() == [2], taken                        # from the checkpoint of update 2
    assert json.loads(taken["detail"].iloc[0]) == {"embedded.lr": [1e-4, 5e-5]}
    assert log.header["plan"]["embedded"]["lr"] == 5e-5                  # the plan that runs now
    meta = json.loads((out / "trainer_state" / "trainer_meta.json").read_text())
    assert meta["version"] == 3 and meta["config"]["optimizer"]["lr"] == 5e-5   # the trainer took it
    code, so, se = _cli([*_resume(first_run, out, 4)])                  # and the saved run's lr is now 5e-5
    assert code == 2 and "embedded.lr" in se and "saved 5e-05, now 0.0001" in se, (code, se[-3000:])


def test_a_corrupt_orchestrator_json_is_named_with_what_is_wrong(first_run: dict[str, Path], tmp_path: Path) -> None:
    out = _copy(first_run, tmp_path)
    orch = out / "trainer_state" / "orchestrator.json"
    good = json.loads(orch.read_text())
    orch.write_text(json.dumps(good)[:40])                 # cut
    log_before = _log_bytes(out)
    code, so, se = _cli(_resume(first_run, out, 3))
    assert code == 2, (code, so[-1500:], se[-3000:])
    _error_line(se, str(orch), "not valid JSON")
    assert _log_bytes(out) == log_before
    from mixfleet.runner.orchestration.resume import prepare_resume

    orch.write_text(json.dumps({**good, "started_prompts": "six"}))
    with pytest.raises(SpecError, match=r"orchestrator.json: field 'started_prompts' = 'six'"):
        prepare_resume(out, load_plan(first_run["plan"]), apply=False)
    orch.write_text(json.dumps({**good, "version": 1}))
    with pytest.raises(SpecError, match=r"field 'version' = 1 .*2, the version of the trainer state beside it"):
        prepare_resume(out, load_plan(first_run["plan"]), apply=False)


def test_a_trainer_state_the_trainer_refuses_is_one_line(first_run: dict[str, Path], tmp_path: Path) -> None:
    """A state file holding more than tensors and plain values is refused by the trainer (torch.load with
    weights_only) inside its Ray actor: that arrived as a 90-line ActorDiedError traceback."""
    out = _copy(first_run, tmp_path)
    pt = out / "trainer_state" / "trainer_state.pt"
    torch.save({"format": "x", "model": datetime.datetime(2020, 1, 1)}, pt)
    tables_before = _log_bytes(out, header=False)
    code, so, se = _cli(_resume(first_run, out, 3))
    assert code == 1, (code, so[-1500:], se[-3000:])
    line = _error_line(se, "the trainer refused its saved state", str(pt), "not a trainer state of tensors and "
                       "plain values")
    assert len(line) < 800, line
    assert _log_bytes(out, header=False) == tables_before              # no row cut, none added
    assert list(RunLog.open(out).updates["version"]) == [1, 2]


def test_a_second_writer_on_one_new_out_is_refused_naming_the_first(first_run: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    """Before: no lock, both ran (60 update rows, each version twice)."""
    out = tmp_path / "new"
    argv = [str(first_run["plan"]), "--out", str(out), "--init", str(first_run["init"]), "--updates", "2"]
    first = subprocess.Popen([sys.executable, "-m", "mixfleet.ui.cli", "run", *argv, "--quiet", "--eval-every", "0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
    try:
        lock = out / ".mixfleet.lock"
        deadline = time.monotonic() + 120
        while not (lock.exists() and lock.read_text().strip() == str(first.pid)):
            assert first.poll() is None and time.monotonic() < deadline, "the first writer never took the lock"
            time.sleep(0.2)
        code, so, se = _cli(argv, timeout_s=240)
        assert code == 2, (code, so[-1500:], se[-3000:])
        _error_line(se, "--out", f"mixfleet pid {first.pid} holds its lock")
    finally:
        with contextlib.suppress(ProcessLookupError):       # (gone already if it ran to its end)
            os.killpg(first.pid, signal.SIGKILL)
        first.wait(60)
