"""A local run's Ray listens on 127.0.0.1 only, and what a killed driver leaves behind is stopped.

The real thing: a child process starts Ray as the runner does (runner/orchestration/actors.py init_ray) with one
embedded sampler replica and the trainer (Megatron-core on torch.distributed), and every socket its process tree
listens on is listed (psutil). Then the child is
killed with kill -9 and `mixfleet cleanup` stops whatever of its Ray outlived it (the agents do). `mixfleet cleanup`
never stops what a hand-written record names (issue 24, the second probe).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from mixfleet.runner.orchestration.local_ray import LOOPBACK_ADDRESSES, listening_sockets
from trust_helpers import end_all, running, sleeper

ROOT = Path(__file__).resolve().parents[1]


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


@pytest.mark.slow
def test_local_ray_binds_loopback_only_and_cleanup_stops_its_leftovers(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model

    ckpt = init_model(load_model_spec("tiny"), tmp_path / "ckpt", seed=0)
    monkeypatch.setenv("MIXFLEET_STATE_DIR", str(tmp_path / "state"))     # only this test's Ray records
    child = subprocess.Popen([sys.executable, str(ROOT / "tests" / "local_ray_child.py"), str(ckpt)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    procs: list[psutil.Process] = []
    try:
        info = None
        deadline = time.monotonic() + 400
        lines = []
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("READY "):
                info = json.loads(line[6:])
                break
        assert info is not None, "".join(lines[-30:])
        # the workers' one-thread settings come with the local Ray's start (inherited), not a runtime_env (which
        # made Ray start every actor's worker through setup_worker: ~1 s of CPU each); the driver's are untouched
        assert info["worker_env"] == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, info
        assert info["driver_env"] == {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}, info
        time.sleep(2.0)                       # let the agents finish binding
        root = psutil.Process(child.pid)
        procs = [root, *root.children(recursive=True)]
        socks = listening_sockets(procs)
        print("\nlistening sockets of the run's process tree (pid, process, address, port):")
        for s in socks:
            print(f"  {s[0]:>7} {s[1]:<24} {s[2]}:{s[3]}")
        names = {s[1] for s in socks}
        assert {"gcs_server", "raylet"} <= names, socks          # the listing sees Ray's own servers
        assert any("TrainerWorker" in n for n in names), socks  # and the trainer's (gloo)
        assert any(p == int(info["url"].rsplit(":", 1)[1]) for *_, p in socks)   # and the sampler's HTTP port
        exposed = [s for s in socks if s[2] not in LOOPBACK_ADDRESSES]
        assert exposed == [], f"listening beyond loopback: {exposed}"

        os.kill(child.pid, signal.SIGKILL)      # the driver dies without shutting its Ray down
        child.wait(timeout=30)
        time.sleep(3.0)
        left = _alive(procs[1:])
        print("left behind by kill -9: " + (", ".join(f"{p.name()}({p.pid})" for p in left) or "nothing"))
        from mixfleet.ui.cli import app
        from typer.testing import CliRunner

        res = CliRunner().invoke(app, ["cleanup"])
        assert res.exit_code == 0, res.output
        print(res.output.strip())
        assert _alive(procs) == [], [p.name() for p in _alive(procs)]
        assert list((tmp_path / "state" / "ray").glob("*.json")) == []
    finally:
        for p in _alive(procs):                  # only the processes this test started
            p.kill()
        if child.poll() is None:
            child.kill()


# ---- `mixfleet cleanup` never stops what a hand-written record names (issue 24, the second probe) ------
def test_cleanup_never_stops_what_a_hand_written_record_names(tmp_path: Path, state: Path) -> None:
    """The probe's record: a dead "driver", an unrelated `sleep` by pid and start time, and another `sleep`
    carrying the record's token in its environment. `mixfleet cleanup` stops neither and drops the record."""
    from mixfleet.runner.orchestration.local_ray import TOKEN_ENV
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    token = uuid.uuid4().hex
    recorded = sleeper()
    marked = sleeper(env={**os.environ, TOKEN_ENV: token})
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        rec = {"driver": {"pid": gone.pid, "create_time": 1.0, "name": "python3"}, "token": token,
               "started_utc": time.time(),
               "processes": [{"pid": recorded.pid, "create_time": psutil.Process(recorded.pid).create_time(),
                              "name": "sleep"}]}
        (state / "ray").mkdir(parents=True)
        path = state / "ray" / f"{gone.pid}-{token[:12]}.json"
        path.write_text(json.dumps(rec))
        res = CliRunner().invoke(app, ["cleanup"])
        assert res.exit_code == 0, res.output
        assert "0 leftover Ray process(es) stopped" in res.output, res.output
        time.sleep(0.3)
        assert running(recorded) and running(marked)
        assert not path.exists()
    finally:
        end_all(recorded, marked)


RAY_CHILD = """
import sys, time
from mixfleet.runner.orchestration.actors import init_ray
init_ray(num_cpus=1)
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_cleanup_still_stops_a_killed_drivers_ray(tmp_path: Path, state: Path) -> None:
    """The other side: a real local Ray whose driver was killed with kill -9 is stopped by `mixfleet cleanup`
    (its agents outlive the driver), while a hand-written record's `sleep` next to it lives."""
    from mixfleet.ui.cli import app
    from typer.testing import CliRunner

    child = subprocess.Popen([sys.executable, "-c", RAY_CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    victim = sleeper()
    procs: list[psutil.Process] = []
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line or line.startswith("READY"):
                break
            lines.append(line)
        assert line.startswith("READY"), "".join(lines[-20:])
        time.sleep(2.0)
        procs = psutil.Process(child.pid).children(recursive=True)
        assert {"gcs_server", "raylet"} <= {p.name() for p in procs}
        gone = subprocess.Popen(["true"])
        gone.wait()
        (state / "ray" / f"{gone.pid}-crafted.json").write_text(json.dumps(
            {"driver": {"pid": gone.pid, "create_time": 1.0}, "token": uuid.uuid4().hex,
             "processes": [{"pid": victim.pid, "create_time": psutil.Process(victim.pid).create_time()}]}))
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
        time.sleep(3.0)
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert left, "nothing outlived the driver: this test would not show cleanup at work"
        res = CliRunner().invoke(app, ["cleanup"])
        assert res.exit_code == 0, res.output
        still = [p.name() for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert still == [], (still, res.output)
        assert running(victim)
        assert list((state / "ray").glob("*.json")) == []
    finally:
        for p in procs:
            try:
                if p.is_running():
                    p.kill()
            except psutil.Error:
                pass
        end_all(victim)
        if child.poll() is None:
            child.kill()
