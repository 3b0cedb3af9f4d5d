"""Issue 26: run-log metrics where RL people look. `mixfleet export RUNLOG --to tensorboard|wandb` (twin and real
logs) and `mixfleet run --tracker`, one mapping (`mixfleet.costmodel.records.trackers.step_metrics`) behind both.

Read back with the libraries' own formats: TensorBoard event files with tensorboard's `EventAccumulator`; the
wandb offline run's `run-<id>.wandb` file (a LevelDB-style record log of wandb's own protobuf `Record`s, read
with wandb's `wandb_internal_pb2`), its CRCs checked. The wandb export runs as its own process with every proxy
and wandb's base URL pointed at a local socket that counts connections: an offline run must make none.
The trackers are the optional extra `mixfleet[trackers]` (in the `test` extra too, so CI runs all of this);
the tests that need one skip, saying which, only where it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from mixfleet.costmodel.records.runlog import (
    EventRecord,
    GroupRecord,
    RunLog,
    RunLogWriter,
    TrajectoryRecord,
    UpdateRecord,
)
from mixfleet.costmodel.records.trackers import PIP_EXTRA, log_step_metrics, start_epoch, step_metrics
from mixfleet.ui.cli import app
from typer.testing import CliRunner

runner = CliRunner()
HAS_TB = importlib.util.find_spec("tensorboard") is not None
HAS_WANDB = importlib.util.find_spec("wandb") is not None
needs_tb = pytest.mark.skipif(not HAS_TB, reason=f"tensorboard is not installed (the trackers extra: {PIP_EXTRA})")
needs_wandb = pytest.mark.skipif(not HAS_WANDB, reason=f"wandb is not installed (the trackers extra: {PIP_EXTRA})")
NAN = math.nan


# ---- helpers: the libraries' own readers ---------------------------------------------------------------------
def tb_scalars(logdir: Path) -> dict[str, dict[int, tuple[float, float]]]:
    """{tag: {step: (value, wall_time)}} as TensorBoard reads the folder (purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: {e.step: (e.value, e.wall_time) for e in ea.Scalars(t)} for t in ea.Tags()["scalars"]}


def wandb_records(path: Path) -> list[Any]:
    """The records of a `run-<id>.wandb` file: header ':W&B' 0xBEE1 v0, then 32 KiB blocks of chunks
    (crc32 seeded with the chunk type, uint16 length, type 1 full / 2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    out, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, n, kind) == (0, 0, 0):
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + n]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad CRC at {pos}"
        pos += 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
    return out


def wandb_history(run_dir: Path) -> tuple[dict[int, dict[str, float]], dict[str, Any]]:
    """({step: {metric: value}}, config) of an offline wandb run folder."""
    (f,) = run_dir.glob("run-*.wandb")
    hist: dict[int, dict[str, float]] = {}
    config: dict[str, Any] = {}
    for r in wandb_records(f):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            hist[r.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "run":
            config = {u.key: json.loads(u.value_json) for u in r.run.config.update}
    return hist, config


def assert_same(got: dict[str, dict[int, float]], steps: list, rel: float = 1e-6) -> None:
    want = {}
    for s in steps:
        for n, v in s.values.items():
            want.setdefault(n, {})[s.step] = v
    assert set(got) == set(want)
    for n in want:
        assert set(got[n]) == set(want[n]), n
        for st, v in want[n].items():
            assert got[n][st] == pytest.approx(v, rel=rel, abs=1e-30), (n, st)


# ---- a small log whose every number is known -------------------------------------------------------------
def _known_log(path: Path) -> Path:
    with RunLogWriter(path, {"source": "runner", "plan": {"name": "p"}, "seed": 0}, flush_every_s=None) as w:
        w.append(EventRecord(time_s=1.0, kind="note", version=0, detail=json.dumps(
            {"eval": "pass_at_k", "k": 2, "version": 0, "pass_at_k": 0.25, "reward": 0.1, "problems": 4})))
        w.append(EventRecord(time_s=1.5, kind="note", detail="killed by --kill-at"))          # not an eval
        for v, (start, end) in enumerate(((2.0, 5.0), (5.0, 9.0)), start=1):
            w.append(UpdateRecord(version=v, start_s=start, end_s=end, train_step_s=2.0, weight_sync_s=0.5,
                                  tokens=100 * v, trajectories=4, staleness_mean=0.5, staleness_p50=0.0,
                                  staleness_p95=1.0, staleness_max=1.0, cost_sampler_usd=0.1 * v,
                                  cost_trainer_usd=0.01 * v, kl_k3=1e-3 * v, reward_mean=0.5 * v, ess=NAN,
                                  tool_s=1.25 * v))
            for g, share in (("bf16", 0.75), ("fp8", 0.25)):
                w.append(GroupRecord(version=v, group=g, replicas_up=1.0, utilization=0.5, tokens_generated=60,
                                     samples=int(4 * share), share_of_samples=share, kl_k3=2e-3 if g == "fp8" else NAN))
            for i in range(2):
                w.append(TrajectoryRecord(run_id=w.run_id, prompt_id="a", sample_index=i, group="bf16", replica=0,
                                          version_start=v - 1, version_end=v - 1, turns=1 + i, prompt_tokens=3,
                                          generated_tokens=10 * (i + 1), start_s=start - 1, end_s=start, reward=1.0,
                                          finish_reason="done", trained_version=v,
                                          tool_calls=i if v == 2 else -1))   # update 1: not recorded (older log)
        w.append(EventRecord(time_s=8.5, kind="note", version=2, detail=json.dumps(
            {"eval": "pass_at_k", "k": 2, "version": 2, "pass_at_k": 0.75, "reward": 0.6, "problems": 4})))
    return path


def test_one_mapping_from_run_log_rows_to_metric_names(tmp_path: Path) -> None:
    steps = log_step_metrics(RunLog.open(_known_log(tmp_path / "run")))
    by = {s.step: s for s in steps}
    assert sorted(by) == [0, 1, 2]
    assert by[0].values == {"eval/pass_at_k": 0.25, "eval/reward": 0.1} and by[0].time_s == 1.0
    u2 = by[2].values
    assert u2["train/reward_mean"] == 1.0 and u2["train/kl_k3"] == 0.002 and u2["train/tokens"] == 200
    assert u2["time/update_s"] == 4.0 and u2["time/update_interval_s"] == 4.0 and u2["time/run_clock_s"] == 9.0
    assert by[1].values["time/update_interval_s"] == 5.0                     # from the run clock's 0
    assert u2["cost/total_usd"] == pytest.approx(0.22) and u2["cost/sampler_usd"] == pytest.approx(0.2)
    assert u2["staleness/p95"] == 1.0 and u2["time/weight_sync_s"] == 0.5
    assert u2["group/bf16/share_of_samples"] == 0.75 and u2["group/fp8/kl_k3"] == 0.002
    assert "group/bf16/kl_k3" not in u2 and "train/ess" not in u2 and "train/kl_k1" not in u2   # NaN: not written
    assert u2["rollout/response_length_mean"] == 15.0 and u2["rollout/response_length_max"] == 20
    assert u2["rollout/turns_mean"] == 1.5
    assert u2["time/tool_s"] == 2.5 and u2["rollout/tool_calls_mean"] == 0.5
    assert "rollout/tool_calls_mean" not in by[1].values                     # -1: not recorded, not written
    assert u2["eval/pass_at_k"] == 0.75 and u2["eval/reward"] == 0.6
    assert "eval/pass_at_k" not in by[1].values
    assert by[2].time_s == 9.0                                              # the update's end, not the eval's
    # a resume that logged update 2 again: it counts once, the last row
    log = RunLog.open(tmp_path / "run")
    upd = log.updates.copy()
    again = upd[upd["version"] == 2].assign(reward_mean=0.9)
    again_steps = step_metrics(pd.concat([upd, again]), log.groups, log.events)
    assert {s.step: s for s in again_steps}[2].values["train/reward_mean"] == 0.9


def test_export_errors_are_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = _known_log(tmp_path / "run")
    r = runner.invoke(app, ["export", str(log), "--to", "mlflow"])
    assert r.exit_code == 2 and "'--to' = 'mlflow'" in r.output and "'tensorboard', 'wandb'" in r.output
    (tmp_path / "plain").mkdir()
    r = runner.invoke(app, ["export", str(tmp_path / "plain"), "--to", "tensorboard"])
    assert r.exit_code == 2 and "a run-log folder" in r.output and "no run.json" in r.output
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "run.json").write_text('{"format": "something-else"}')
    r = runner.invoke(app, ["export", str(tmp_path / "other"), "--to", "tensorboard"])
    assert r.exit_code == 2 and "not a mixfleet run-log header" in r.output
    r = runner.invoke(app, ["export", str(log), "--to", "tensorboard", "--out", str(log / "tb")])
    assert r.exit_code == 2 and "outside the run folder" in r.output and not (log / "tb").exists()
    # the extra missing: each library made unimportable in this process (what an install without it is)
    for tracker, pkg in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        with monkeypatch.context() as m:
            for name in [n for n in sys.modules if n == pkg or n.startswith(pkg + ".")] or [pkg]:
                m.setitem(sys.modules, name, None)
            m.setitem(sys.modules, pkg, None)
            r = runner.invoke(app, ["export", str(log), "--to", tracker, "--out", str(tmp_path / tracker)])
        assert r.exit_code == 2, r.output
        assert f"needs the '{pkg}' package" in r.output and 'pip install "mixfleet[trackers]"' in r.output
        assert not (tmp_path / tracker).exists()


@needs_tb
def test_export_a_twin_log_to_tensorboard_read_back_by_tensorboard(tmp_path: Path) -> None:
    log = tmp_path / "runs" / "twin"
    r = runner.invoke(app, ["simulate", "tiny-cpu", "--updates", "3", "--out", str(log), "--json"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["export", str(log), "--to", "tensorboard"])
    assert r.exit_code == 0, r.output
    dest = tmp_path / "runs" / "tensorboard" / "twin"                       # the default: beside the run folder
    assert f"to tensorboard: {dest}" in r.output
    got = tb_scalars(dest)
    rl = RunLog.open(log)
    steps = log_step_metrics(rl)
    assert [s.step for s in steps] == [1, 2, 3]
    assert_same({t: {s: v for s, (v, _) in d.items()} for t, d in got.items()}, steps)
    assert {"train/reward_mean", "train/kl_k3", "time/update_interval_s", "cost/total_usd",
            "group/cpu-fp8/kl_k3", "group/cpu-nvfp4/share_of_samples", "rollout/response_length_mean"} <= set(got)
    assert "train/ess" not in got                                           # the twin has none: NaN, left out
    epoch, ends = start_epoch(rl.header), dict(zip(rl.updates["version"], rl.updates["end_s"], strict=True))
    for st, (_, wall) in got["train/reward_mean"].items():
        assert wall == pytest.approx(epoch + ends[st], abs=1e-3)            # TensorBoard's relative axis: run clock
    # a second export does not append to the first; --force replaces its event file
    r = runner.invoke(app, ["export", str(log), "--to", "tensorboard"])
    assert r.exit_code == 2 and "--force replaces them" in r.output
    r = runner.invoke(app, ["export", str(log), "--to", "tensorboard", "--force", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["steps"] == 3
    assert len(list(dest.glob("events.out.tfevents.*"))) == 1 and tb_scalars(dest).keys() == got.keys()


class _Counter:
    """A local TCP listener that counts connections (every proxy and wandb's base URL point here)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections, self.stop = 0, False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            c.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        self.sock.close()


@needs_wandb
def test_export_to_wandb_offline_read_back_and_no_network(tmp_path: Path) -> None:
    log = _known_log(tmp_path / "runs" / "real")
    counter = _Counter()
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and "proxy" not in k.lower()}
    env.update(HOME=str(home), WANDB_MODE="online", WANDB_BASE_URL=counter.url,     # online asked: offline forced
               HTTP_PROXY=counter.url, HTTPS_PROXY=counter.url, ALL_PROXY=counter.url, http_proxy=counter.url,
               https_proxy=counter.url, all_proxy=counter.url, NO_PROXY="", no_proxy="")
    out = tmp_path / "wb"
    try:
        p = subprocess.run([sys.executable, "-m", "mixfleet.ui.cli", "export", str(log), "--to", "wandb",
                            "--out", str(out), "--json"], env=env, capture_output=True, text=True, timeout=300)
    finally:
        counter.close()
    assert p.returncode == 0, p.stderr[-3000:]
    assert counter.connections == 0                                         # no login, no upload, no error report
    res = json.loads(p.stdout)
    run_dir = Path(res["dest"])
    assert run_dir.parent == out / "wandb" and run_dir.name.startswith("offline-run-")
    assert not (home / ".netrc").exists()
    hist, config = wandb_history(run_dir)
    steps = log_step_metrics(RunLog.open(log))
    assert sorted(hist) == [0, 1, 2]
    got: dict[str, dict[int, float]] = {}
    for st, vals in hist.items():
        for n, v in vals.items():
            got.setdefault(n, {})[st] = v
    assert_same(got, steps, rel=1e-12)
    assert config["source"] == "runner" and config["plan"] == {"name": "p"} and config["seed"] == 0
    assert res["steps"] == 3 and "eval/pass_at_k" in res["metrics"]


# ---- live: what `mixfleet run --tracker` does after each update ---------------------------------------------
@needs_tb
def test_live_tracker_writes_each_update_as_it_is_logged_and_a_resume_replaces_replayed_steps(tmp_path: Path) -> None:
    from mixfleet.costmodel.records.trackers import LiveTracker

    run, tb = tmp_path / "run", tmp_path / "tb"
    w = RunLogWriter(run, {"source": "runner", "plan": {"name": "p"}}, flush_every_s=None)
    live = LiveTracker.from_options([f"tensorboard={tb}"], run)
    assert live is not None and not tb.exists()                              # opened at the first update

    def update(v: int, reward: float) -> None:
        w.append(UpdateRecord(version=v, start_s=v, end_s=v + 0.5, train_step_s=0.4, weight_sync_s=0.1, tokens=8,
                              trajectories=2, staleness_mean=0, staleness_p50=0, staleness_p95=0, staleness_max=0,
                              cost_sampler_usd=v, cost_trainer_usd=0, reward_mean=reward))
        w.flush()
        live.on_update(v)

    update(1, 0.1)
    assert tb_scalars(tb)["train/reward_mean"].keys() == {1}                # written now, not at the end
    update(2, 0.2)
    assert {s: v for s, (v, _) in tb_scalars(tb)["train/reward_mean"].items()} == pytest.approx({1: 0.1, 2: 0.2})
    live.close()
    w.close()
    # a fresh run into the same folder is refused (--force replaces); a resume streams the log again, and
    # TensorBoard keeps the resumed file's values where the two differ (the replayed update 2)
    with pytest.raises(ValueError, match="--force replaces them"):
        LiveTracker.from_options([f"tensorboard={tb}"], run)
    w = RunLogWriter(run, {"source": "runner"}, flush_every_s=None)
    w.truncate_after_version(1)
    live = LiveTracker.from_options([f"tensorboard={tb}"], run, resume=True)
    assert live is not None
    update(2, 0.25)
    update(3, 0.3)
    live.close()
    w.close()
    got = {s: v for s, (v, _) in tb_scalars(tb)["train/reward_mean"].items()}
    assert got == pytest.approx({1: 0.1, 2: 0.25, 3: 0.3}) and len(list(tb.glob("events.out.tfevents.*"))) == 2
    with pytest.raises(ValueError, match="'--tracker' = 'mlflow'"):
        LiveTracker.from_options(["mlflow"], run)
    with pytest.raises(ValueError, match="outside the run folder"):
        LiveTracker.from_options([f"tensorboard={run / 'tb'}"], run)


def test_mixfleet_run_tracker_bad_input_is_refused_before_anything_starts(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    r = runner.invoke(app, ["run", "tiny-cpu", "--out", str(out), "--tracker", "mlflow"])
    assert r.exit_code == 2 and "'--tracker' = 'mlflow'" in r.output and not out.exists()
    r = runner.invoke(app, ["run", "tiny-cpu", "--out", str(out), "--tracker", "tensorboard",
                            "--tracker", "tensorboard=x"])
    assert r.exit_code == 2 and "each tracker once" in r.output and not out.exists()
    with monkeypatch.context() as m:
        for name in [n for n in sys.modules if n == "wandb" or n.startswith("wandb.")] or ["wandb"]:
            m.setitem(sys.modules, name, None)
        m.setitem(sys.modules, "wandb", None)
        r = runner.invoke(app, ["run", "tiny-cpu", "--out", str(out), "--tracker", "wandb"])
    assert r.exit_code == 2 and "--tracker wandb: the wandb tracker needs the 'wandb' package" in r.output
    assert 'pip install "mixfleet[trackers]"' in r.output and not out.exists()


@pytest.mark.slow
@needs_tb
@needs_wandb
def test_mixfleet_run_tracker_on_a_real_tiny_run_streams_what_export_writes(tmp_path: Path) -> None:
    """A real run (tiny model, Ray, the trainer, embedded samplers): 2 updates, a held-out evaluation at the
    start and at update 2, streamed live to TensorBoard and wandb; read back, both equal the export of the
    finished run log."""
    from runplans import CPU_BF16, CPU_FP8, run_files, run_plan_toml

    plan_toml = run_plan_toml(
        "test-tracker", [CPU_BF16, CPU_FP8], embedded={"max_turns": 2, "max_new_tokens": 8, "eval_every": 2,
                                                        "pass_k": 2, "extra": {"eval_problems": 2}},
        batcher={"prompts_per_update": 2, "samples_per_prompt": 2, "inflight_prompts": 4})
    init, plan = run_files(tmp_path, plan_toml)
    out, tb, wb = tmp_path / "runs" / "live", tmp_path / "tb-live", tmp_path / "wb-live"
    r = runner.invoke(app, ["run", str(plan), "--out", str(out), "--init", str(init), "--updates", "2", "--quiet",
                            "--tracker", f"tensorboard={tb}", "--tracker", f"wandb={wb}"])
    assert r.exit_code == 0, r.output[-3000:]
    log = RunLog.open(out)
    assert log.header["status"] == "finished" and log.source == "runner"
    steps = log_step_metrics(log)
    assert [s.step for s in steps] == [0, 1, 2]                              # eval of the base policy, 2 updates
    live = tb_scalars(tb)
    assert_same({t: {s: v for s, (v, _) in d.items()} for t, d in live.items()}, steps)
    assert {"train/reward_mean", "train/kl_k3", "train/ess", "time/train_step_s", "group/cpu-fp8/kl_k3",
            "group/cpu-bf16/utilization", "eval/pass_at_k", "eval/reward"} <= set(live)
    assert set(live["eval/pass_at_k"]) == {0, 2}
    # the export of the finished (real) log: the same scalars, the same wall times
    r = runner.invoke(app, ["export", str(out), "--to", "tensorboard"])
    assert r.exit_code == 0, r.output
    exported = tb_scalars(tmp_path / "runs" / "tensorboard" / "live")
    assert exported.keys() == live.keys()
    for t in live:   # pytest >= 9.2's approx takes no tuples inside a mapping: steps equal, then (value, wall)
        assert exported[t].keys() == live[t].keys(), t
        assert [x for s in sorted(live[t]) for x in exported[t][s]] == pytest.approx(
            [x for s in sorted(live[t]) for x in live[t][s]]), t
    (run_dir,) = (wb / "wandb").glob("offline-run-*")
    hist, config = wandb_history(run_dir)
    got: dict[str, dict[int, float]] = {}
    for st, vals in hist.items():
        for n, v in vals.items():
            got.setdefault(n, {})[st] = v
    assert_same(got, steps, rel=1e-12)
    assert config["plan"]["name"] == "test-tracker" and config["source"] == "runner"
