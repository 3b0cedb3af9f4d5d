"""Studies of many real runs (the ablation, the learning ladder): one driver that starts, watches, retries and
resumes them, each in its own child process with its own local Ray.

A study is a list of `StudyRun`s: a name, an output folder, a plan (a shipped name or a TOML path) with dotted-key
overrides (the plan's run settings too: `embedded.lr`, ...), and what the run needs beyond its plan (`RUN_FIELDS`:
updates, seed, mode, ...); each child prepares its run with the runner's one recipe (recipe.py `prepare_run`).
Everything a run is goes to `RUN_FILE` in its folder (what it is, before it starts) and the study's manifest (its
state, status, wall time, attempts), both written atomically.

Each run is a child process of the runner's launcher (runner/orchestration/launcher.py `start_child`, `kill_child`,
and `launch` in the child: the Ray start with its retries, SIGTERM stopping after the current update).

Resumable: a run whose log says "finished" at >= its target updates is skipped; an unfinished one (killed, failed,
or finished at fewer updates than now asked) is continued from its trainer checkpoint with `resume=True` (the
runner cuts its log back to that checkpoint), and refused without it, so nothing is silently overwritten. Runs go
one at a time by default (`parallel=1`: a 2-core machine); a run that fails is continued from its checkpoint up
to `retries` times; one still going after `run_timeout_s` is killed with its process group.

Interrupted (SIGINT, e.g. Ctrl-C, or SIGTERM to the driver; a run leads its own process group, so neither reaches
it on its own): every running run is asked to stop after its current update (it checkpoints), its process group is
killed if it has not exited within `stop_grace_s` or on a second signal, the manifest marks it "interrupted", and
the driver exits 128 + the signal's number. `--resume` continues the study.

    python -m mixfleet.studies.runs --child JOB_JSON     # what `run_study` starts per run
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.runner.orchestration import launcher

RUN_FILE = "study_run.json"
# what a study run sets beyond its plan (RunConfig fields; the plan's run settings are dotted overrides)
RUN_FIELDS = ("updates", "seed", "mode", "ray_num_cpus", "allow_group_loss", "batcher_overrides")
# a child's defaults on a 2-core machine: one torch thread per part (a study run's overrides go over them)
CHILD_OVERRIDES = {"embedded.trainer_threads": 1, "embedded.threads_per_replica": 1}
LOG_PARTS = ("run.json", "trajectories", "updates", "groups", "events", "trainer_state", "weights")


@dataclass(frozen=True, kw_only=True)
class StudyRun:
    """One run of a study: its plan, the overrides that make it, and the runner's settings."""

    name: str                                        # e.g. "mixed/grpo/seed0" (unique in the study)
    out_dir: Path
    plan: str                                        # shipped plan name or TOML path
    overrides: Mapping[str, Any] = field(default_factory=dict)   # dotted plan keys -> values
    run: Mapping[str, Any] = field(default_factory=dict)         # RUN_FIELDS (updates, seed, mode, ...)
    meta: Mapping[str, Any] = field(default_factory=dict)        # written to RUN_FILE with the rest (labels, ...)
    run_file: str = RUN_FILE
    base_policy: str = ""                            # this run's base checkpoint ("": the study's)

    def __post_init__(self) -> None:
        from mixfleet.costmodel.errors import SpecError

        for key, value in self.run.items():
            if key not in RUN_FIELDS:
                raise SpecError(f"study run '{self.name}'", f"run.{key}", value,
                                f"one of {', '.join(RUN_FIELDS)} (a plan setting is a dotted override of the plan, "
                                f"e.g. embedded.{key})")

    @property
    def updates(self) -> int:
        return int(self.run.get("updates", 30))


@dataclass(frozen=True, kw_only=True)
class StudySettings:
    """How a study's runs are driven (validated on construction)."""

    resume: bool = False
    parallel: int = 1
    run_timeout_s: float = 3600.0
    start_gap_s: float = 30.0                       # between two child starts (Ray start-ups overload a small host)
    retries: int = 2
    keep_weights: bool = False                      # the weights folder is only needed to resume a run
    stop_grace_s: float = 300.0                     # interrupted: how long a run may take to finish its update

    def __post_init__(self) -> None:
        for name, lo in (("parallel", 1), ("retries", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"study {name} = {v!r}; allowed: an integer >= {lo}")
        for name in ("run_timeout_s", "stop_grace_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"study {name} = {getattr(self, name)!r}; allowed: > 0")
        if not self.start_gap_s >= 0:
            raise ValueError(f"study start_gap_s = {self.start_gap_s!r}; allowed: >= 0")


def run_state(out_dir: Path, updates: int) -> str:
    """"new" (no log), "finished" (log finished at >= updates), "partial" (anything else with a log)."""
    if not (out_dir / "run.json").exists():
        return "new"
    try:
        from mixfleet.costmodel.records.runlog import RunLog

        log = RunLog.open(out_dir)
        done = int(log.updates["version"].max()) if len(log.updates) else 0
        status = str(log.header.get("status", ""))
    except Exception:  # noqa: BLE001 - an unreadable log is unfinished
        return "partial"
    return "finished" if status == "finished" and done >= updates else "partial"


def run_states(runs: Sequence[StudyRun], *, resume: bool, where: str, folder: Path) -> dict[str, str]:
    """Each run's `run_state`; unfinished runs without `resume` are refused, naming them and --resume."""
    states = {r.name: run_state(r.out_dir, r.updates) for r in runs}
    partial = [r.name for r in runs if states[r.name] == "partial"]
    if partial and not resume:
        raise ValueError(f"{where}: unfinished runs under {folder}: {', '.join(partial)}; allowed: "
                         "pass resume (--resume) to continue them, or remove their folders")
    return states


def merge_manifest(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A study's description after one more call into its folder: a study is often run in several calls (one
    fleet, variant or seed at a time) into one folder, and the last call's description alone would say the
    folder holds only its own plans and rungs. Tables are merged key by key (recursively), lists keep the old
    items and add the new ones, anything else is the new call's."""
    out = dict(old)
    for k, v in new.items():
        o = out.get(k)
        if isinstance(o, Mapping) and isinstance(v, Mapping):
            out[k] = merge_manifest(o, v)
        elif isinstance(o, list) and isinstance(v, list | tuple):
            out[k] = o + [x for x in v if x not in o]
        else:
            out[k] = v
    return out


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _job(run: StudyRun, base_policy: str, resume: bool) -> dict[str, Any]:
    return {"name": run.name, "out_dir": str(run.out_dir), "plan": run.plan, "overrides": dict(run.overrides),
            "run": dict(run.run), "meta": dict(run.meta), "run_file": run.run_file,
            "base_policy": run.base_policy or base_policy, "resume": resume}


def run_study(runs: Sequence[StudyRun], *, manifest_path: Path, manifest_extra: Mapping[str, Any],
              base_policy: str, settings: StudySettings, log: Callable[[str], Any] = print,
              child_module: str = "mixfleet.studies.runs", states: Mapping[str, str] | None = None
              ) -> dict[str, Any]:
    """Run (or continue) every run; returns the manifest (also written to `manifest_path`). `states`: what
    `run_states` already said of these runs (a caller that checks before preparing its base policy)."""
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"study: run names must be distinct; got {names}")
    states = dict(states) if states is not None else \
        run_states(runs, resume=settings.resume, where="study", folder=manifest_path.parent)
    manifest_path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    kept = {k: v for k, v in old.items() if k not in ("runs", "finished_unix_s")}
    manifest: dict[str, Any] = {**merge_manifest(kept, manifest_extra), "base_policy": base_policy,
                                "runs": old.get("runs", {}), "started_unix_s": old.get("started_unix_s", time.time())}
    for r in runs:
        manifest["runs"].setdefault(r.name, {})["state"] = states[r.name]
    write_json(manifest_path, manifest)
    todo = [r for r in runs if states[r.name] != "finished"]
    log(f"study: {len(runs)} runs, {len(runs) - len(todo)} finished, {len(todo)} to run "
        f"(parallel {settings.parallel}), base policy {base_policy}")
    running: list[tuple[StudyRun, subprocess.Popen, float]] = []
    with _interruptible() as again:
        try:
            _drive(todo, running, states, manifest, manifest_path, settings, base_policy, child_module, log)
        except _Interrupted as stop:
            _stop_running(running, manifest, manifest_path, settings, log, again)
            log(f"study interrupted ({stop.signame}); continue it with --resume")
            raise SystemExit(128 + stop.signum) from None
    manifest["finished_unix_s"] = time.time()
    write_json(manifest_path, manifest)
    return manifest


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum, self.signame = signum, signal.Signals(signum).name


@contextlib.contextmanager
def _interruptible() -> Iterator[threading.Event]:
    """SIGINT and SIGTERM raise `_Interrupted` in the driver's loop (a run leads its own process group, so a
    terminal's Ctrl-C reaches only the driver: without this the runs would go on without it). A second signal
    while the runs are being stopped sets the returned event: kill them now. Off the main thread: no handlers."""
    again = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield again
        return
    armed = [True]

    def handler(signum: int, _frame: Any) -> None:
        if armed[0]:
            armed[0] = False
            raise _Interrupted(signum)
        again.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield again
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop_running(running: list[tuple[StudyRun, subprocess.Popen, float]], manifest: dict[str, Any],
                  manifest_path: Path, settings: StudySettings, log: Callable[[str], Any],
                  again: threading.Event) -> None:
    """Ask every running run to stop after its current update (it checkpoints: resumable); kill the process
    group of one that has not exited within `stop_grace_s` (or at once on a second signal). The manifest says
    "interrupted" for each, with the state its log is in."""
    for r, child, _ in running:
        with contextlib.suppress(ProcessLookupError):
            launcher.stop_child(child.pid)
        log(f"  stop  {r.name}: asked to stop after its current update (up to {settings.stop_grace_s:.0f} s)")
    deadline = time.monotonic() + settings.stop_grace_s
    for r, child, t0 in running:
        while child.poll() is None and time.monotonic() < deadline and not again.is_set():
            time.sleep(0.2)
        if child.poll() is None:
            launcher.kill_child(child.pid)
            child.wait()
            log(f"  killed {r.name}: still running at the stop deadline")
        entry = manifest["runs"][r.name]
        entry.update(state=run_state(r.out_dir, r.updates), status="interrupted", exit_code=child.returncode,
                     wall_s=entry.get("wall_s", 0.0) + time.monotonic() - t0)
        entry.pop("pid", None)
        write_json(manifest_path, manifest)
    running.clear()


def _drive(todo: list[StudyRun], running: list[tuple[StudyRun, subprocess.Popen, float]],
           states: dict[str, str], manifest: dict[str, Any], manifest_path: Path, settings: StudySettings,
           base_policy: str, child_module: str, log: Callable[[str], Any]) -> None:
    queue = list(todo)
    attempts = dict.fromkeys(states, 0)
    last_start = -float("inf")
    while queue or running:
        while queue and len(running) < settings.parallel and time.monotonic() - last_start >= settings.start_gap_s:
            last_start = time.monotonic()
            r = queue.pop(0)
            r.out_dir.mkdir(parents=True, exist_ok=True)
            attempts[r.name] += 1
            resume = states[r.name] == "partial"
            argv = [sys.executable, "-m", child_module, "--child", json.dumps(_job(r, base_policy, resume))]
            child = launcher.start_child(argv, log_path=r.out_dir / "driver.log")   # its own process group
            running.append((r, child, time.monotonic()))
            manifest["runs"][r.name].update(state="running", resumed=resume, pid=child.pid)
            write_json(manifest_path, manifest)
            log(f"  start {r.name}{' (resume)' if resume else ''}")
        time.sleep(0.5)
        for item in list(running):
            r, child, t0 = item
            rc = child.poll()
            timed_out = rc is None and time.monotonic() - t0 > settings.run_timeout_s
            if timed_out:
                launcher.kill_child(child.pid)                 # the run and its Ray: one process group
                rc = child.wait()
            if rc is None:
                continue
            running.remove(item)
            state = run_state(r.out_dir, r.updates)
            status = "timeout" if timed_out else state if rc == 0 else f"failed (exit {rc})"
            wall = time.monotonic() - t0
            entry = manifest["runs"][r.name]
            entry.update(state=state, status=status, wall_s=entry.get("wall_s", 0.0) + wall, exit_code=rc,
                         attempts=attempts[r.name])
            entry.pop("pid", None)
            write_json(manifest_path, manifest)
            log(f"  done  {r.name}: {status} in {wall:.0f} s")
            if state != "finished" and not timed_out and attempts[r.name] <= settings.retries:
                states[r.name] = "partial" if state == "partial" else "new"
                queue.append(r)                                # continue it from its checkpoint, at the end
                log(f"  retry {r.name} later (attempt {attempts[r.name] + 1} of {settings.retries + 1})")


def run_child(job: Mapping[str, Any]) -> dict[str, Any]:
    """One run, in this process (the driver's child): the plan with its overrides prepared by the runner's one
    recipe (runner/orchestration/recipe.py `prepare_run`, the folder managed by the driver: claim=False) and run
    through the launcher (the Ray start and its retries, SIGTERM stops after the current update)."""
    import torch
    from mixfleet.policies.plan import load_plan
    from mixfleet.runner.orchestration.recipe import prepare_run

    torch.set_num_threads(1)
    out = Path(job["out_dir"])
    if not job["resume"]:
        for name in LOG_PARTS:
            p = out / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    write_json(out / job["run_file"], {**job["meta"], "name": job["name"], "plan_ref": job["plan"],
                                       "overrides": job["overrides"], "run": job["run"],
                                       "base_policy": job["base_policy"]})
    settings = {"ray_num_cpus": 2, **dict(job["run"])}
    prepared = prepare_run(load_plan(job["plan"]), {**CHILD_OVERRIDES, **dict(job["overrides"])}, out,
                           init=job["base_policy"], resume=bool(job["resume"]), claim=False, where="study run",
                           **settings)
    plan, cfg = prepared.plan, prepared.config

    def on_update(view: Any, _orch: Any) -> None:
        print(f"update {view.version}/{view.target} reward {view.reward_mean:.3f} k3 {view.kl_k3:.2e} "
              f"t {view.elapsed_s:.0f}s", flush=True)

    result = launcher.launch(plan, cfg, on_update=on_update).result
    if not job["meta"].get("keep_weights", False):
        shutil.rmtree(out / "weights", ignore_errors=True)   # only needed to resume; the log stays
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m mixfleet.studies.runs --child JOB_JSON` (what `run_study` starts per run)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "--child":
        print("usage: python -m mixfleet.studies.runs --child JOB_JSON (started by a study driver)", file=sys.stderr)
        return 2
    result = run_child(json.loads(args[1]))
    print(json.dumps({"result": result}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
