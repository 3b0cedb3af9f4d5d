"""One launcher for a real run's lifecycle: every front end (the CLI `mixfleet run`, the app's managed runs
in ui/run_manager.py, the studies in studies/runs.py) starts, stops and resumes a run through it.

In the run's own process:
- `fleet_mode(plan, ...)`: which samplers a run starts (embedded on a machine of CPUs or with `--embedded`,
  attached servers, or SGLang servers on a Ray cluster), refused when none fits;
- `prepare(out, plan, ...)` (called by recipe.py `prepare_run`, the one recipe of a run): the run folder locked
  for the whole run, checked (a new or empty folder, or the run a resume continues), and a resume checked
  against the log (`resume.prepare_resume`, nothing changed) before the base policy or Ray start;
- `launch(plan, config, ...)`: the run itself (`orchestrator.run_plan`). SIGTERM (the app's Stop, a
  scheduler's) stops it after the update under way: checkpointed, its log closed "stopped", resumable with
  `resume=True` / `--resume`. The Ray start and its retries are `actors.init_ray`'s (one loop); it hands SIGTERM
  back to this handler after `ray.init` took it.

Around it, in a parent:
- `run_argv(...)`: the `mixfleet run` command line of a child run (the app's managed runs);
- `start_child(argv, log_path=...)`: the child in a session of its own (it and its local Ray are one process
  group), its output appended to `log_path`;
- `stop_child(pid)`: SIGTERM (stop after the current update); `kill_child(pid)`: SIGKILL to its process group
  (only a process that leads its own group), the log left readable and resumable.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError

CLI_MODULE = "mixfleet.ui.cli"
STOP_MESSAGE = "SIGTERM: stopping after the current update (checkpointed, resumable)"


# ---- in the run's process --------------------------------------------------------------------------------
def fleet_mode(plan: Any, *, embedded: bool = False, address: str | None = None,
               attach: Mapping[str, Sequence[str]] | None = None) -> str:
    """The fleet mode of a run (runner/orchestration/fleet.py MODES): "attach" with attached servers,
    "embedded" when asked or when every group's accelerator is a CPU, "sglang" on a Ray cluster (`address`);
    a plan of GPUs with none of these is refused (SpecError naming what to pass)."""
    from mixfleet.costmodel.specs.catalog import load_catalog
    from mixfleet.runner.orchestration.rehearsal import CPU_KINDS

    if attach:
        return "attach"
    cat = load_catalog(plan.price_table or None)
    kinds = set()
    for g in plan.groups:
        try:
            kinds.add(cat.accelerator(g.accelerator).kind)
        except SpecError:
            kinds.add("unknown")
    if embedded or kinds <= set(CPU_KINDS):
        return "embedded"
    if address is None:
        raise SpecError(f"plan '{plan.name}'", "accelerators", sorted(g.accelerator for g in plan.groups),
                        "CPUs for a local run; pass --embedded to rehearse this plan locally, --address of a "
                        "Ray cluster whose nodes carry these accelerators, or --attach GROUP=URL")
    return "sglang"


def prepare(out: Path, plan: Any, *, resume: bool, force: bool = False, where: str = "mixfleet run",
            take_new_settings: bool = False) -> Any:
    """Lock the run folder `out` (one writer; the run takes the lock again, re-entrantly) and check it under the
    lock: a new or empty folder, `force` to replace what an earlier run wrote, or with `resume` the run it
    continues (its plan the log's, or differing only in run settings it takes with `take_new_settings`; its
    checkpoint readable; nothing is changed yet). Returns the lock (release
    it when the run ends); raises SpecError / ValueError naming the problem, the lock released."""
    from mixfleet.costmodel.records.outdir import claim_output_dir
    from mixfleet.runner.orchestration.resume import prepare_resume

    lock = claim_output_dir(out, "run", where=where, resume=resume, force=force)
    try:
        if resume:
            prepare_resume(out, plan, where=where, apply=False, take_new_settings=take_new_settings)
    except BaseException:
        lock.release()
        raise
    return lock


class StopOnSigterm:
    """While entered: SIGTERM asks the run to stop after its current update (`asked`; the orchestrator handed
    to `attach` gets `stop_requested`). The previous handler is put back on exit."""

    def __init__(self, say: Callable[[str], Any] | None = print) -> None:
        self.asked = False
        self.orch: Any = None
        self.say = say
        self._previous: Any = None

    def _handler(self, _sig: int, _frame: Any) -> None:
        self.asked = True
        if self.orch is not None:
            self.orch.stop_requested = True
        if self.say is not None:
            self.say(STOP_MESSAGE)

    def attach(self, orch: Any) -> None:
        self.orch = orch
        if self.asked:
            orch.stop_requested = True

    def __enter__(self) -> StopOnSigterm:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


@dataclass(frozen=True)
class Outcome:
    """How a launched run ended: `result` is run_plan's summary; `stopped` when SIGTERM ended it early."""

    result: dict[str, Any]
    stopped: bool


def launch(plan: Any, config: Any, *, on_update: Callable[[Any, Any], Any] | None = None,
           on_event: Callable[[Any], Any] | None = None, setup: Callable[[Any], Any] | None = None,
           say: Callable[[str], Any] | None = print) -> Outcome:
    """Run `plan` per `config` (a RunConfig) in this process, SIGTERM stopping it after the current update
    (module doc); `setup(orch)` before it starts (fault hooks). Errors are run_plan's (RunFailed, ...)."""
    from mixfleet.runner.orchestration.orchestrator import run_plan

    with StopOnSigterm(say) as stop:
        def begin(orch: Any) -> None:
            stop.attach(orch)
            if setup is not None:
                setup(orch)

        result = run_plan(plan, config, on_update=on_update, on_event=on_event, setup=begin)
    return Outcome(result=result, stopped=stop.asked and int(result.get("version", 0)) < int(config.updates))


# ---- around it: a child process ----------------------------------------------------------------------------
def run_argv(plan_path: str | Path, out: str | Path, *, updates: int | None = None, resume: bool = False,
             init: str | None = None, address: str | None = None, attach: Sequence[str] = (),
             embedded: bool = False, quiet: bool = True, python: str = sys.executable) -> list[str]:
    """The command line of `mixfleet run` as a child process (its first six items are the same for every run
    of `plan_path` into `out`: what a parent looks for in /proc)."""
    cmd = [python, "-m", CLI_MODULE, "run", str(plan_path), "--out", str(out)]
    if updates is not None:
        cmd += ["--updates", str(int(updates))]
    if quiet:
        cmd.append("--quiet")
    if resume:
        cmd.append("--resume")
    if init:
        cmd += ["--init", init]
    if address:
        cmd += ["--address", address]
    for a in attach:
        cmd += ["--attach", a]
    if embedded:
        cmd.append("--embedded")
    return cmd


def start_child(argv: Sequence[str], *, log_path: str | Path, cwd: str | Path | None = None,
                banner: str | None = None) -> subprocess.Popen:
    """Start `argv` in a new session (so it and its local Ray are one process group a kill takes whole), stdin
    closed, stdout and stderr appended to `log_path` (after `banner`, if given), Python unbuffered."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with Path(log_path).open("ab") as log:
        if banner is not None:
            log.write(f"\n{banner}\n".encode())
            log.flush()
        return subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(cwd) if cwd is not None else None, env=env, start_new_session=True)


def stop_child(pid: int) -> None:
    """Ask a launched run to stop after its current update (SIGTERM; `launch` in the child does the rest)."""
    os.kill(pid, signal.SIGTERM)


def kill_child(pid: int) -> None:
    """SIGKILL to the process group a launched run leads (the run and its local Ray). Refuses a process that
    does not lead its own group (it was not started by `start_child`); a process already gone is no error."""
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return
    if group != pid:
        raise RuntimeError(f"pid {pid} does not lead its own process group (group {group}); not killing a group "
                           "that is not the run's")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
