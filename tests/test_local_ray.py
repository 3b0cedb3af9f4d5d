"""A local run's Ray listens on 127.0.0.1 only, and what a killed driver leaves behind is stopped.

The real thing: a child process starts Ray as the runner does (runner/orchestration/actors.py init_ray) with one
embedded sampler replica and the trainer (Megatron-core on torch.distributed), and every socket its process tree
listens on is listed (psutil). Then the child is
killed with kill -9 and `mixfleet cleanup` stops whatever of its Ray outlived it (the agents do).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mixfleet.runner.orchestration.local_ray import LOOPBACK_ADDRESSES, listening_sockets

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
