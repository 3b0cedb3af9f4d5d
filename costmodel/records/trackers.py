"""A run log's metrics for TensorBoard and Weights & Biases: one mapping, two writers, export and live.

The mapping (`step_metrics`) turns run-log rows into named scalars per step, the step being the trainer
version (update `v` is step `v`; an evaluation of the base policy is step 0):

- `updates` rows -> `train/...` (reward, KL, masked / extreme shares, ESS, entropy, grad norm, loss, tokens,
  trajectories), `staleness/...`, `time/...` (train step, weight sync, the batch's seconds in its tools, update,
  interval since the previous update, run clock) and `cost/...` (cumulative sampler / trainer / total USD):
  `UPDATE_METRICS`, `derived` below;
- `groups` rows -> `group/<name>/<column>` for each column of `GROUP_METRICS`;
- `trajectories` trained in the update -> `rollout/response_length_mean`, `rollout/response_length_max`,
  `rollout/turns_mean`, `rollout/tool_calls_mean` (where recorded);
- held-out evaluations, the `note` events whose detail JSON has `"eval": "pass_at_k"` -> `eval/pass_at_k`,
  `eval/reward` (an update row's `pass_at_k` without such an event gives `eval/pass_at_k` alone).

NaN (what a world does not produce, e.g. the twin's ESS) is left out, never written. `mixfleet export` writes
the whole log at once; `LiveTracker` (`mixfleet run --tracker`) writes each update's steps as the run logs
them, from the same rows through the same mapping, so the two give the same scalars.

Writers: TensorBoard event files through `tensorboard`'s own `EventFileWriter` (no TensorFlow, no torch),
wall time = the run's start (`created_utc`) + the run clock, so TensorBoard's "relative" axis is the run
clock (simulated seconds for a twin log); wandb in offline mode only: the run folder is written under the
destination (`WANDB_DIR`), nothing is sent, no login is asked (`wandb sync` uploads it later). Both are the
optional extra `pip install "mixfleet[trackers]"`; without it every entry point says so.

No torch here (costmodel/ imports neither torch nor anything above it).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import pandas as pd
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.outdir import check_outside_run_logs, check_parent_is_folder
from mixfleet.costmodel.records.runlog import RunLog

TRACKERS = ("tensorboard", "wandb")
PIP_EXTRA = 'pip install "mixfleet[trackers]"'
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
EVENT_FILE_PREFIX = "events.out.tfevents."
WANDB_PROJECT = "mixfleet"

# updates column -> metric name
UPDATE_METRICS: dict[str, str] = {
    "reward_mean": "train/reward_mean",
    "kl_k1": "train/kl_k1",
    "kl_k3": "train/kl_k3",
    "masked_share": "train/masked_share",
    "extreme_share": "train/extreme_share",
    "extreme_low_share": "train/extreme_low_share",
    "extreme_high_share": "train/extreme_high_share",
    "ess": "train/ess",
    "entropy": "train/entropy",
    "grad_norm": "train/grad_norm",
    "loss": "train/loss",
    "tokens": "train/tokens",
    "trajectories": "train/trajectories",
    "staleness_mean": "staleness/mean",
    "staleness_p50": "staleness/p50",
    "staleness_p95": "staleness/p95",
    "staleness_max": "staleness/max",
    "train_step_s": "time/train_step_s",
    "weight_sync_s": "time/weight_sync_s",
    "tool_s": "time/tool_s",
    "end_s": "time/run_clock_s",
    "cost_sampler_usd": "cost/sampler_usd",
    "cost_trainer_usd": "cost/trainer_usd",
}
# computed from an update row (and the one before it)
DERIVED_METRICS = ("time/update_s", "time/update_interval_s", "cost/total_usd")
# groups columns, each as group/<name>/<column>
GROUP_METRICS = ("replicas_up", "utilization", "tokens_generated", "samples", "share_of_samples", "kl_k3", "kl_k1",
                 "kl_k3_on_policy", "kl_k1_on_policy", "tokens_on_policy", "masked_share", "extreme_share",
                 "staleness_mean", "tokens_trained", "cost_usd", "routing_token_share", "routing_layer_share")
ROLLOUT_METRICS = ("rollout/response_length_mean", "rollout/response_length_max", "rollout/turns_mean",
                   "rollout/tool_calls_mean")
EVAL_METRICS = {"pass_at_k": "eval/pass_at_k", "reward": "eval/reward"}     # note-event detail key -> name


@dataclass
class StepMetrics:
    """The scalars of one step (trainer version) and when it happened on the run clock."""

    step: int
    time_s: float
    values: dict[str, float] = field(default_factory=dict)


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _put(out: dict[int, StepMetrics], step: int, time_s: float | None, name: str, value: Any) -> None:
    v = _num(value)
    if v is None:
        return
    s = out.setdefault(step, StepMetrics(step, math.nan))
    s.values[name] = v
    if time_s is not None and math.isfinite(time_s) and not s.time_s >= time_s:
        s.time_s = float(time_s)


def _group_key(name: Any) -> str:
    return str(name).replace("/", "_") or "_"


def eval_detail(detail: Any) -> dict[str, Any] | None:
    """The detail of a held-out evaluation `note` event (JSON with "eval": "pass_at_k"), else None."""
    if not isinstance(detail, str) or '"eval"' not in detail:
        return None
    try:
        d = json.loads(detail)
    except json.JSONDecodeError:
        return None
    return d if isinstance(d, dict) and d.get("eval") == "pass_at_k" else None


EVAL_SETTINGS = ("task", "temperature", "top_p", "max_new_tokens", "max_turns", "precision")  # since 2026-12-01
                                                                                    # (top_p: 12-02; None before: 1)
EVAL_COLUMNS = ("version", "reward", "pass_at_k", "k", "problems", *EVAL_SETTINGS)


def eval_frame(events: pd.DataFrame | None) -> pd.DataFrame:
    """A run log's held-out evaluations (its `note` events read by `eval_detail`), one row per version (the last,
    if a resume evaluated a version twice), sorted by version: EVAL_COLUMNS, None where an older log lacks one."""
    rows = []
    if events is not None and len(events) and "kind" in events:
        for d in events[events["kind"] == "note"]["detail"]:
            rec = eval_detail(d)
            if rec is not None and isinstance(rec.get("version"), int):
                rows.append({c: rec.get(c) for c in EVAL_COLUMNS})
    df = pd.DataFrame(rows, columns=list(EVAL_COLUMNS))
    return df.drop_duplicates("version", keep="last").sort_values("version").reset_index(drop=True)


def step_metrics(updates: pd.DataFrame, groups: pd.DataFrame, events: pd.DataFrame,
                 trajectories: pd.DataFrame | None = None) -> list[StepMetrics]:
    """The one mapping from run-log rows to tracker metrics (module doc), sorted by step. An update logged twice
    (a resume replays it) counts once, the last row."""
    out: dict[int, StepMetrics] = {}
    if len(updates):
        upd = updates.drop_duplicates("version", keep="last").sort_values("version")
        prev_end = 0.0
        for row in upd.to_dict("records"):
            v, end = int(row["version"]), _num(row.get("end_s"))
            for col, name in UPDATE_METRICS.items():
                _put(out, v, end, name, row.get(col))
            start = _num(row.get("start_s"))
            if end is not None and start is not None:
                _put(out, v, end, "time/update_s", end - start)
            if end is not None:
                _put(out, v, end, "time/update_interval_s", end - prev_end)
                prev_end = end
            cs, ct = _num(row.get("cost_sampler_usd")), _num(row.get("cost_trainer_usd"))
            if cs is not None and ct is not None:
                _put(out, v, end, "cost/total_usd", cs + ct)
            _put(out, v, end, "eval/pass_at_k", row.get("pass_at_k"))   # replaced below by the eval's own event
    if len(groups):
        ends = {s: m.time_s for s, m in out.items()}
        for row in groups.drop_duplicates(["version", "group"], keep="last").to_dict("records"):
            v, g = int(row["version"]), _group_key(row["group"])
            for col in GROUP_METRICS:
                _put(out, v, ends.get(v), f"group/{g}/{col}", row.get(col))
    if trajectories is not None and len(trajectories) and "trained_version" in trajectories:
        tr = trajectories[trajectories["trained_version"] > 0]
        if len(tr):
            by = tr.groupby("trained_version")
            stats = pd.DataFrame({"len_mean": by["generated_tokens"].mean(), "len_max": by["generated_tokens"].max(),
                                  "turns": by["turns"].mean()})
            for v, row in stats.iterrows():
                t = out[int(v)].time_s if int(v) in out else None
                _put(out, int(v), t, "rollout/response_length_mean", row["len_mean"])
                _put(out, int(v), t, "rollout/response_length_max", row["len_max"])
                _put(out, int(v), t, "rollout/turns_mean", row["turns"])
            if "tool_calls" in tr:                       # -1: not recorded (logs before tool_calls)
                calls = tr[tr["tool_calls"] >= 0].groupby("trained_version")["tool_calls"].mean()
                for v, x in calls.items():
                    _put(out, int(v), out[int(v)].time_s if int(v) in out else None, "rollout/tool_calls_mean", x)
    if len(events):
        notes = events[events["kind"] == "note"]
        for row in notes.to_dict("records"):
            d = eval_detail(row.get("detail"))
            if d is None:
                continue
            v = d.get("version", row.get("version"))
            if _num(v) is None or int(v) < 0:
                continue
            for key, name in EVAL_METRICS.items():
                _put(out, int(v), _num(row.get("time_s")), name, d.get(key))
    return [out[s] for s in sorted(out)]


def log_step_metrics(log: RunLog) -> list[StepMetrics]:
    """`step_metrics` of a run log read with `RunLog.open`."""
    return step_metrics(log.updates, log.groups, log.events, log.trajectories)


def metric_names(steps: Iterable[StepMetrics]) -> list[str]:
    return sorted({n for s in steps for n in s.values})


def start_epoch(header: Mapping[str, Any]) -> float:
    """Unix time of the run clock's 0: the header's `created_utc` (now, if it has none)."""
    try:
        return datetime.fromisoformat(str(header["created_utc"])).timestamp()
    except (KeyError, ValueError):
        return time.time()


# ---- the optional libraries ---------------------------------------------------------------------------
class TrackerMissing(SpecError):
    """A tracker's library is not installed: the message names the pip command."""

    def __init__(self, tracker: str, where: str) -> None:
        pkg = _PACKAGES[tracker]
        self.where, self.field, self.value, self.allowed = where, tracker, f"{pkg} not installed", PIP_EXTRA
        ValueError.__init__(self, f"{where}: the {tracker} tracker needs the '{pkg}' package, which is not "
                                  f"installed; install the trackers extra: {PIP_EXTRA} (or pip install {pkg})")


def check_tracker(name: str, where: str) -> str:
    """`name` is one of TRACKERS and its library imports; else a SpecError (unknown) or TrackerMissing."""
    if name not in TRACKERS:
        raise SpecError(where, "tracker", name, TRACKERS)
    try:
        if name == "tensorboard":
            from tensorboard.compat.proto import event_pb2  # noqa: F401
            from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401
        else:
            _offline_wandb_env(None)
            import wandb  # noqa: F401
    except ImportError:
        raise TrackerMissing(name, where) from None
    return name


def event_files(folder: Path) -> list[Path]:
    """TensorBoard event files directly in `folder`."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith(EVENT_FILE_PREFIX) and p.is_file())


MANAGED_RECORD = "managed.json"     # beside RUNS/<name>/run of a run the app started (ui/run_manager.py)


def run_log_name(run_dir: Path) -> str:
    """A run log's name in trackers: its folder's, or for a run the app started (RUNS/<name>/run with the app's
    record beside it) <name>: every app run was "run" in TensorBoard (issue 44)."""
    run_dir = Path(run_dir)
    return run_dir.parent.name if _app_run(run_dir) else run_dir.name


def _app_run(run_dir: Path) -> bool:
    return run_dir.name == "run" and (run_dir.parent / MANAGED_RECORD).is_file()


def default_dest(tracker: str, run_dir: Path) -> Path:
    """Where a run log's metrics go by default: beside the run folder, so one TensorBoard logdir or wandb
    folder collects many runs (`RUNS/tensorboard/<run>`, `RUNS/wandb/offline-run-...`); an app run's
    RUNS/<name>/run goes to RUNS/tensorboard/<name>, beside the other runs (`run_log_name`)."""
    run_dir = Path(run_dir)
    runs = run_dir.parent.parent if _app_run(run_dir) else run_dir.parent
    return runs / "tensorboard" / run_log_name(run_dir) if tracker == "tensorboard" else runs


def check_dest(tracker: str, dest: Path, run_dir: Path, *, where: str, flag: str, replace: bool,
               force: bool) -> None:
    """May metrics be written to `dest`? Never into a run folder (it holds only what a run writes); a
    TensorBoard folder that already has event files only when `replace` (a resumed run, which purges the
    replayed steps) or `force` (they are removed when writing starts)."""
    d, r = Path(dest).resolve(), Path(run_dir).resolve()
    if d == r or r in d.parents:
        raise SpecError(where, flag, str(dest), "a folder outside the run folder (a run folder holds only what "
                                                "the run writes)")
    if d.exists() and not d.is_dir():
        raise SpecError(where, flag, str(dest), "a folder (this is a file)")
    check_parent_is_folder(Path(dest), where=where, flag=flag, what="a folder")           # FILE/sub
    check_outside_run_logs(d, where=where, flag=flag, what="a folder")      # another run's `updates/`, ...
    if tracker == "tensorboard" and event_files(d) and not (replace or force):
        raise SpecError(where, flag, str(dest), f"a folder without TensorBoard event files (it has "
                                                f"{len(event_files(d))}); --force replaces them")


# ---- writers --------------------------------------------------------------------------------------------
class MetricWriter(Protocol):
    dest: Path

    def write(self, step: StepMetrics) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    """Scalars into a TensorBoard event file in `dest`, through tensorboard's own `EventFileWriter`.

    The first step written is preceded by a SessionLog START at that step: TensorBoard then drops what older
    event files in the folder hold from that step on (a resumed run writes its replayed steps once)."""

    def __init__(self, dest: Path, epoch: float, *, remove_old: bool = False) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.dest, self.epoch = Path(dest), epoch
        if remove_old:
            for p in event_files(self.dest):
                p.unlink()
        self.dest.mkdir(parents=True, exist_ok=True)
        self._w = EventFileWriter(str(self.dest), max_queue_size=1000, flush_secs=30)
        self._started = False

    def write(self, step: StepMetrics) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        wall = self.epoch + (step.time_s if math.isfinite(step.time_s) else 0.0)
        if not self._started:
            self._w.add_event(event_pb2.Event(wall_time=wall, step=step.step,
                                              session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
            self._started = True
        values = [summary_pb2.Summary.Value(tag=n, simple_value=v) for n, v in sorted(step.values.items())]
        self._w.add_event(event_pb2.Event(wall_time=wall, step=step.step, summary=summary_pb2.Summary(value=values)))

    def flush(self) -> None:
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def _offline_wandb_env(dest: Path | None) -> None:
    """wandb's environment for an offline run that touches no network: offline mode, no error reports (Sentry),
    quiet; set before wandb is imported (Sentry starts at import)."""
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_ERROR_REPORTING"] = "false"
    os.environ["WANDB_SILENT"] = "true"
    if dest is not None:
        os.environ["WANDB_DIR"] = str(dest)


class WandbWriter:
    """One wandb run in offline mode under `dest` (its folder: `dest/wandb/offline-run-<time>-<id>/`).

    Named after the run folder, grouped by plan, job type = the log's source (twin / runner), config = the
    run log's header (plan, seed, versions). No console capture, system stats, git or code saving."""

    def __init__(self, dest: Path, header: Mapping[str, Any], name: str) -> None:
        self.dest = Path(dest)
        self.dest.mkdir(parents=True, exist_ok=True)
        _offline_wandb_env(self.dest)
        import wandb

        plan = header.get("plan") if isinstance(header.get("plan"), dict) else {}
        config = {k: header.get(k) for k in ("run_id", "source", "seed", "plan", "versions", "created_utc")}
        settings = wandb.Settings(mode="offline", console="off", silent=True, disable_git=True, save_code=False,
                                  x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True)
        self.run = wandb.init(dir=str(self.dest), project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
                              name=name, group=str(plan.get("name") or "") or None,
                              job_type=str(header.get("source") or "run"), tags=[str(header.get("source") or "run")],
                              config=config, mode="offline", settings=settings)
        self.run_dir = Path(self.run.dir).parent            # .../offline-run-<time>-<id>
        self._last = -1

    def write(self, step: StepMetrics) -> None:
        if step.step < self._last:                            # wandb keeps steps increasing
            return
        self.run.log(dict(step.values), step=step.step)
        self._last = step.step

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


def open_writer(tracker: str, dest: Path, header: Mapping[str, Any], name: str, *,
                remove_old: bool = False) -> TensorBoardWriter | WandbWriter:
    if tracker == "tensorboard":
        return TensorBoardWriter(dest, start_epoch(header), remove_old=remove_old)
    return WandbWriter(dest, header, name)


# ---- export ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExportResult:
    tracker: str
    dest: Path                  # the TensorBoard logdir, or the wandb offline run's folder
    steps: int
    values: int
    metrics: list[str]


def export_run_log(runlog: str | os.PathLike[str], to: str, out: str | os.PathLike[str] | None = None, *,
                   force: bool = False, where: str = "mixfleet export") -> ExportResult:
    """Write a run log's metrics (twin or real) to TensorBoard or wandb (offline). Checked first, in this order:
    the tracker name, that RUNLOG is a run log, that the tracker's library is installed, the destination."""
    if to not in TRACKERS:
        raise SpecError(where, "--to", to, TRACKERS)
    run_dir = Path(runlog)
    why = RunLog.not_a_run_log(run_dir)
    if why is not None:
        raise SpecError(where, "RUNLOG", str(run_dir), f"a run-log folder (from mixfleet simulate or mixfleet "
                                                       f"run); this one: {why}")
    check_tracker(to, f"{where} --to {to}")
    dest = Path(out) if out is not None else default_dest(to, run_dir)
    check_dest(to, dest, run_dir, where=where, flag="--out", replace=False, force=force)
    log = RunLog.open(run_dir)
    steps = log_step_metrics(log)
    w = open_writer(to, dest, log.header, run_log_name(run_dir), remove_old=force)
    try:
        for s in steps:
            w.write(s)
    finally:
        w.close()
    return ExportResult(to, getattr(w, "run_dir", dest), len(steps), sum(len(s.values) for s in steps),
                        metric_names(steps))


# ---- live: mixfleet run --tracker ---------------------------------------------------------------------
class LiveTracker:
    """Streams a run's metrics to trackers as the run logs them: `on_update(version)` after each update (the
    run log is flushed by then) writes every step up to `version` not written yet, from the run log through
    `step_metrics`: what `mixfleet export` would write for those updates. The writers open at the first
    update (wandb's run then carries the run's header). A tracker that fails while the run goes on is dropped
    with a warning: the run log stays complete, and `mixfleet export` can write it later.

    A resumed run streams its whole history again from step 0 / 1: TensorBoard's folder purges the earlier
    file's steps from there; wandb gets a new offline run."""

    def __init__(self, run_dir: Path, dests: Mapping[str, Path], *, force: bool = False) -> None:
        self.run_dir, self.dests, self.force = Path(run_dir), dict(dests), force
        self.writers: dict[str, TensorBoardWriter | WandbWriter] = {}
        self.log: RunLog | None = None
        self.written = -1                                  # last step written
        self.warnings: list[str] = []

    @classmethod
    def from_options(cls, items: Iterable[str], run_dir: Path, *, resume: bool = False, force: bool = False,
                     where: str = "mixfleet run") -> LiveTracker | None:
        """`--tracker NAME` or `NAME=DIR` items (NAME one of TRACKERS; DIR by default `default_dest`), checked
        now: the name, the library, the destination. None when there are none."""
        dests: dict[str, Path] = {}
        for item in items:
            name, sep, d = item.partition("=")
            name = name.strip()
            if name not in TRACKERS:
                raise SpecError(where, "--tracker", item, "NAME or NAME=DIR with NAME one of "
                                                          + ", ".join(repr(t) for t in TRACKERS))
            if name in dests:
                raise SpecError(where, "--tracker", item, f"each tracker once ({name} is given twice)")
            check_tracker(name, f"{where} --tracker {name}")
            dest = Path(d.strip()) if sep and d.strip() else default_dest(name, run_dir)
            check_dest(name, dest, run_dir, where=where, flag="--tracker", replace=resume, force=force)
            dests[name] = dest
        return cls(run_dir, dests, force=force and not resume) if dests else None

    def _open(self) -> None:
        self.log = RunLog.open(self.run_dir)
        for name, dest in self.dests.items():
            try:
                self.writers[name] = open_writer(name, dest, self.log.header, run_log_name(self.run_dir),
                                                 remove_old=self.force)
            except Exception as exc:                    # noqa: BLE001 - a tracker never stops the run
                self._warn(name, "could not start", exc)

    def _warn(self, name: str, what: str, exc: BaseException) -> None:
        msg = f"warning: --tracker {name} {what} ({type(exc).__name__}: {exc}); the run goes on, its run log " \
              f"is complete (mixfleet export {self.run_dir} --to {name} writes it later)"
        self.warnings.append(msg)
        print(msg, file=sys.stderr, flush=True)

    def on_update(self, version: int) -> None:
        if self.log is None:
            self._open()
        else:
            self.log.refresh()
        assert self.log is not None
        new = [s for s in log_step_metrics(self.log) if self.written < s.step <= version]
        for name, w in list(self.writers.items()):
            try:
                for s in new:
                    w.write(s)
                w.flush()
            except Exception as exc:                    # noqa: BLE001 - a tracker never stops the run
                self._warn(name, "failed", exc)
                self.writers.pop(name)
                self._close_quietly(w)
        if new:
            self.written = new[-1].step

    @staticmethod
    def _close_quietly(w: MetricWriter) -> None:
        try:
            w.close()
        except Exception:                               # noqa: BLE001
            pass

    def close(self) -> None:
        for name, w in list(self.writers.items()):
            try:
                w.close()
            except Exception as exc:                    # noqa: BLE001
                self._warn(name, "did not close cleanly", exc)
        self.writers.clear()

    def where(self) -> dict[str, str]:
        """Each tracker's folder (wandb: its offline run's, once open)."""
        return {n: str(getattr(self.writers.get(n), "run_dir", d)) for n, d in self.dests.items()}
