"""A test-sized real run (tiny model, 2 sampler groups, Ray actors, Megatron-core trainer) through its faults.

One child process runs the plan with two drills: the second group's weight load of version 1 fails (a
truncated checkpoint: the engine refuses it and keeps serving version 0), and after update 1 a replica of
the first group is killed while it serves. The test then kills the whole child (SIGKILL to its process
group, Ray included) once an update >= 3 has trained a re-routed session, and resumes the run in this
process for one more update.

Checked in the run log (read with the same RunLog reader the twin's logs use): updates 1..N exactly once
(no duplicated or lost update), each update's trajectories present once with their trained version, the crash
logged with its restart and a replica ready again, the killed replica's sessions re-routed (restarts > 0)
and the run going on, the failed weight load logged while the group keeps serving version 0, per-group KL
and staleness recorded, the resume counted in the header and as an event.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.policies.plan import load_plan
from mixfleet.runner.orchestration.orchestrator import RunConfig, run_plan
from runplans import CPU_BF16, CPU_FP8, FIXED_EVERY_1S, run_files, run_plan_toml

PLAN = run_plan_toml(
    "test-run", [CPU_BF16, CPU_FP8], trainer={"loss": "sc_mis", "top_p": 0.95, "top_p_replay": True},
    autoscaler=FIXED_EVERY_1S, batcher={"prompts_per_update": 2, "samples_per_prompt": 3, "inflight_prompts": 4},
    embedded={"max_turns": 3, "max_new_tokens": 12})

CHILD_TIMEOUT_S = 480
MAX_CHILD_UPDATES = 40                 # an upper bound: the child is killed as soon as the log shows the replacement


def _replaced_in_log(out: Path) -> bool:
    """The first group's crash, then its replacement's restart and ready events, are in the log on disk."""
    ev = RunLog.open(out).events
    ev = ev[ev["group"] == "cpu-bf16"]
    crash = ev[ev["kind"] == "crash"]
    if crash.empty:
        return False
    t = float(crash["time_s"].min())
    after = ev[ev["time_s"] >= t]
    return bool((after["kind"] == "restart").any() and (after["kind"] == "ready").any())


@pytest.fixture(scope="module")
def killed_then_resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("run")
    init, plan_path = run_files(root, PLAN)
    out = root / "out"
    argv = [sys.executable, str(Path(__file__).with_name("run_child.py")), str(plan_path), str(out), str(init),
            str(MAX_CHILD_UPDATES)]
    err = open(root / "child.err", "w")  # noqa: SIM115 - closed below
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    seen: list[str] = []
    last = 0
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        assert child.stdout is not None
        for line in child.stdout:
            seen.append(line.strip())
            parts = line.split()
            if len(parts) == 4 and parts[0] == "UPDATE":
                last = int(parts[1])
                # kill once a re-routed session has been trained and the replacement replica is up, both in
                # the run log on disk (it is flushed before each UPDATE line), at update 3 or later
                if (last >= 3 and int(parts[2]) > 0 and _replaced_in_log(out)) or last >= MAX_CHILD_UPDATES - 1:
                    break
            if time.monotonic() > deadline:
                break
    finally:
        os.killpg(child.pid, signal.SIGKILL)          # kill the whole run: driver, Ray, actors
        child.wait(30)
        err.close()
    tail = (root / "child.err").read_text()[-2000:]
    assert last >= 3, f"the child did not reach update 3: {seen[-5:]}; its stderr ends with:\n{tail}"
    assert json.loads((out / "run.json").read_text())["status"] == "running"   # killed, not closed
    cfg = RunConfig(out_dir=out, updates=last + 1, init_checkpoint=str(init), resume=True, ray_num_cpus=2)
    res = run_plan(load_plan(plan_path), cfg)
    assert res["version"] == last + 1
    return out


def test_resume_has_no_duplicated_or_lost_update(killed_then_resumed: Path) -> None:
    log = RunLog.open(killed_then_resumed)
    assert log.source == "runner" and log.header["status"] == "finished" and log.header["resumes"] == 1
    n = int(log.updates["version"].max())
    assert n >= 4 and sorted(log.updates["version"].tolist()) == list(range(1, n + 1))
    tr = log.trajectories
    trained = tr[tr["trained_version"] > 0]
    counts = trained.groupby("trained_version").size().to_dict()
    per_update = dict(zip(log.updates["version"], log.updates["trajectories"], strict=True))
    assert counts == per_update                       # every update's batch logged once
    # each trajectory's tool calls and seconds in its tools, and each update's tool seconds = its batch's sum
    assert (trained["tool_calls"] >= 0).all() and (trained["tool_calls"] <= trained["turns"]).all()
    assert (trained["tool_s"] >= 0).all() and trained["tool_s"].sum() > 0
    tool = trained.groupby("trained_version")["tool_s"].sum()
    up = log.updates.set_index("version")["tool_s"]
    assert up.to_numpy() == pytest.approx(tool.reindex(up.index).to_numpy(), rel=1e-9, abs=1e-12)
    assert (log.events["kind"] == "resume").sum() == 1
    assert sorted(log.groups["version"].unique().tolist()) == list(range(1, n + 1))
    assert set(log.groups["group"]) == {"cpu-bf16", "cpu-fp8"}


def test_killed_replica_is_rerouted_and_replaced(killed_then_resumed: Path) -> None:
    log = RunLog.open(killed_then_resumed)
    ev = log.events
    crash = ev[(ev["kind"] == "crash") & (ev["group"] == "cpu-bf16")]
    assert len(crash) >= 1
    t_crash = float(crash["time_s"].min())
    assert ((ev["kind"] == "restart") & (ev["group"] == "cpu-bf16") & (ev["time_s"] >= t_crash)).any()
    assert ((ev["kind"] == "ready") & (ev["group"] == "cpu-bf16") & (ev["time_s"] > t_crash)).any()
    assert int(log.trajectories["restarts"].sum()) >= 1   # sessions on the killed replica moved
    assert log.updates["version"].max() >= 4              # and the run went on


def test_failed_weight_load_keeps_the_previous_version(killed_then_resumed: Path) -> None:
    log = RunLog.open(killed_then_resumed)
    ev = log.events
    failed = ev[(ev["kind"] == "weight_push_failed") & (ev["group"] == "cpu-fp8")]
    assert len(failed) >= 1 and (failed["version"] == 1).all()
    assert failed["detail"].str.startswith("serving version 0").all()
    ok = ev[(ev["kind"] == "weight_push") & (ev["group"] == "cpu-bf16") & (ev["version"] == 1)]
    assert len(ok) == 1 and json.loads(ok["detail"].iloc[0])["loaded"] == 1


def test_metrics_by_group_and_staleness_are_recorded(killed_then_resumed: Path) -> None:
    log = RunLog.open(killed_then_resumed)
    up = log.updates
    assert up["kl_k3"].notna().all() and up["reward_mean"].notna().all() and (up["tokens"] > 0).all()
    assert up["staleness_max"].max() >= 1             # asynchronous: some tokens are off-policy
    g = log.groups
    assert g[g["tokens_trained"] > 0]["kl_k3"].notna().all()
    assert (g.groupby("version")["samples"].sum().to_dict() == up.set_index("version")["trajectories"].to_dict())


def test_the_ledgers_columns_mean_what_they_mean_in_the_twin(killed_then_resumed: Path) -> None:
    log = RunLog.open(killed_then_resumed)
    up, g = log.updates.sort_values("version"), log.groups
    assert up["extreme_share"].notna().all()
    assert (up["extreme_share"] - up["extreme_low_share"] - up["extreme_high_share"]).abs().max() < 1e-12
    cost_t = up["cost_trainer_usd"].to_numpy()
    assert (cost_t > 0).all() and (cost_t[1:] >= cost_t[:-1]).all()   # the plan's trainer price x run clock
    bf16 = g[g["group"] == "cpu-bf16"]
    # time-weighted, not a snapshot: the window with the kill and the replacement's start has less than 1 up
    assert ((bf16["replicas_up"] > 0) & (bf16["replicas_up"] < 0.999)).any()
    assert (g["cost_usd"] > 0).all()
    fresh = g[g["tokens_on_policy"] > 0]
    assert len(fresh) and fresh["kl_k3_on_policy"].notna().all()      # per-group on-policy KL is a column
    assert not (log.events["kind"] == "note").any()                   # (no longer a note; no eval in this run)
