"""twin/core.py runs compiled (Cython, built by setup.py at install) or as the plain Python it is: both give the
same dry runs, row for row, with the same event count. Each side runs in its own process (MIXFLEET_PURE_PYTHON=1
selects the source); the plans cover the real rate tables, a warm and a cold start, preemptions with restarts,
drain-mode weight sync and autoscaling."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import mixfleet.twin.core as core
import pytest

RUN = r"""
import hashlib, json, sys, tempfile
import mixfleet.twin.core as core
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.policies.plan import load_plan, plan_from_dict
from mixfleet.twin.sim import simulate

def digest(plan, **kw):
    with tempfile.TemporaryDirectory() as d:
        r = simulate(plan, out=d, **kw)
        log, h = RunLog.open(d), hashlib.sha256()
        for t in ("trajectories", "updates", "groups", "events"):
            h.update(log.table(t).drop(columns=["run_id"], errors="ignore").to_csv(index=False).encode())
        ev = log.events.kind
        return {"sha": h.hexdigest(), "events": r.events, "simulated_s": r.simulated_s, "rows": len(log.trajectories),
                "preempted": int((ev == "preempt").sum()), "scaled": int(ev.isin(["scale_up", "scale_down"]).sum()),
                "restarts": int(log.trajectories.restarts.sum())}

seed = load_plan("seed-mixed")
raw = seed.to_dict()
raw["faults"] = {"preemptions_per_replica_hour": 1.0, "on_loss": "restart"}
raw["policies"]["weight_sync"] = {"name": "drain"}
raw["policies"]["autoscaler"] = {"name": "queue_based", "interval_s": 30.0}
for g in raw["groups"]:
    g["min_replicas"], g["max_replicas"] = max(g["replicas"] - 1, 0), g["replicas"] + 2
faulty = plan_from_dict(raw)
out = {"compiled": core.COMPILED,
       "warm": digest(seed, updates=2, warm_start=True),
       "cold_faults_drain": digest(faulty, updates=1)}
print(json.dumps(out))
"""


def _run(pure: bool) -> dict:
    env = {**os.environ, "MIXFLEET_PURE_PYTHON": "1" if pure else "0"}
    p = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_the_core_is_compiled_where_the_install_could_compile_it() -> None:
    if os.environ.get("MIXFLEET_PURE_PYTHON", "") not in ("", "0"):
        pytest.skip("MIXFLEET_PURE_PYTHON is set: the source runs by request")
    if not shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc"):
        pytest.skip("no C compiler here: the install keeps twin/core.py as Python")
    assert core.COMPILED, ("twin/core.py runs as Python although a C compiler is here: re-install "
                           "(pip install -e .) so setup.py compiles it")


@pytest.mark.timeout(900)
def test_compiled_and_pure_python_cores_give_the_same_runs() -> None:
    if not core.COMPILED:
        pytest.skip("twin/core.py is not compiled in this install: there is only one side to compare")
    compiled, pure = _run(pure=False), _run(pure=True)
    assert compiled.pop("compiled") is True and pure.pop("compiled") is False
    faulty = compiled["cold_faults_drain"]
    assert compiled["warm"]["rows"] > 1000 and faulty["rows"] > 500
    assert faulty["preempted"] > 0 and faulty["restarts"] > 0 and faulty["scaled"] > 0  # those paths ran
    assert compiled == pure
