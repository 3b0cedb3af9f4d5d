"""Real runs the app starts, stops and resumes: `mixfleet run` as a managed background process.

A managed run lives in its own folder under the runs root:

    RUNS/<name>/plan.toml      the plan, written as given (the run reads this file)
    RUNS/<name>/managed.json   who runs it: pid, the process's start time (so a reused pid is not taken
                               for it), the command, when it started, the target updates
    RUNS/<name>/driver.log     the driver's stdout and stderr (the page shows its tail)
    RUNS/<name>/run/           the run folder (`--out`): run log, trainer state, weights

The process is `python -m mixfleet.ui.cli run RUNS/<name>/plan.toml --out RUNS/<name>/run --quiet ...`
in a new session (never a thread of the Streamlit script), so it outlives the app; an app restarted later
finds it again from managed.json and the process table. A start holds an exclusive lock file while it
checks and launches, so two sessions of the app cannot start a run twice. Only runs with a managed.json
written here are ever stopped or killed: a run the app did not start is followed, never signalled.

Stop is clean: SIGTERM, on which `mixfleet run` finishes the update it is on, checkpoints and closes its
run log with status "stopped" (resumable). Kill is SIGKILL to the run's process group (its local Ray
included); the run log stays readable and `--resume` continues from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANAGED_FILE = "managed.json"
PLAN_FILE = "plan.toml"
LOG_FILE = "driver.log"
RUN_SUBDIR = "run"
LOCK_FILE = ".managed.lock"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_PLAN_BYTES = 1 << 20          # a plan file is small; refuse anything bigger
MAX_UPDATES = 100_000
LOG_TAIL_BYTES = 16_384


class RunManagerError(ValueError):
    """A managed-run request that cannot be done as asked; the message says why and what to do."""


@dataclass
class ManagedRun:
    """One run started by the app (read from / written to RUNS/<name>/managed.json)."""

    folder: str
    pid: int
    pid_start: str                 # /proc/<pid>/stat field 22 (start time in clock ticks since boot)
    command: list[str]
    started_utc: str
    updates: int
    resumes: int = 0
    stop_requested_utc: str | None = None
    killed_utc: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return Path(self.folder).name

    @property
    def run_dir(self) -> Path:
        return Path(self.folder) / RUN_SUBDIR

    @property
    def log_path(self) -> Path:
        return Path(self.folder) / LOG_FILE

    def alive(self) -> bool:
        """True while the process that this record names is running (same pid AND same start time)."""
        return _pid_start(self.pid) == self.pid_start

    def header(self) -> dict[str, Any]:
        """The run log's header (run.json), or {} before the run wrote it."""
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.run_dir / "run.json").read_text())
        return {}

    def state(self) -> str:
        """running | stopping | finished | stopped | failed | killed | exited (what the page shows)."""
        if self.alive():
            return "stopping" if self.stop_requested_utc else "running"
        status = self.header().get("status")
        if self.killed_utc:
            return "killed"
        if status in ("finished", "stopped", "failed"):
            return str(status)
        return "exited"            # the process is gone without closing its log (crashed or killed outside)

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - max_bytes))
                return f.read().decode("utf-8", errors="replace")
        except OSError:
            return ""


# ---- processes -------------------------------------------------------------------------------------
def _pid_start(pid: int) -> str | None:
    """The start time of process `pid` from /proc (None if there is no such process or it is a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = stat[stat.rfind(")") + 2:].split()   # the command name may hold spaces and parentheses
    if rest and rest[0] == "Z":
        return None
    return rest[19] if len(rest) > 19 else None


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _inside(root: Path, p: Path) -> bool:
    try:
        p.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def _lock(folder: Path):  # type: ignore[no-untyped-def]
    """An exclusive lock file in `folder` for the check-and-launch of a start (stale after 60 s)."""
    path = folder / LOCK_FILE
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            break
        except FileExistsError:
            with contextlib.suppress(OSError):
                if time.time() - path.stat().st_mtime > 60:
                    path.unlink()
                    continue
            raise RunManagerError(f"run folder {folder}: another start is in progress; try again in a moment") from None
    else:
        raise RunManagerError(f"run folder {folder}: cannot take its lock {path}")
    try:
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()


# ---- the manager -----------------------------------------------------------------------------------
def load(folder: str | Path) -> ManagedRun | None:
    """The managed run in `folder`, or None if the app did not start one there."""
    p = Path(folder) / MANAGED_FILE
    try:
        data = json.loads(p.read_text())
        return ManagedRun(**{k: data[k] for k in ManagedRun.__dataclass_fields__ if k in data})
    except (OSError, ValueError, TypeError, KeyError):
        return None


def find(root: str | Path) -> list[ManagedRun]:
    """Every managed run directly under the runs root, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = [m for p in sorted(root.iterdir()) if p.is_dir() and (m := load(p)) is not None]
    out.sort(key=lambda m: m.started_utc, reverse=True)
    return out


def run_folder(root: str | Path, name: str) -> Path:
    """RUNS/<name>, refusing names that are not one plain path component."""
    if not NAME_RE.match(name or ""):
        raise RunManagerError(f"run name {name!r}: allowed 1-64 characters of letters, digits, '.', '_', '-', "
                              "starting with a letter or digit (one folder under the runs folder)")
    root = Path(root).resolve()
    folder = root / name
    if not _inside(root, folder):
        raise RunManagerError(f"run name {name!r}: must stay inside the runs folder {root}")
    return folder


def _launch(folder: Path, plan: Path, updates: int, resume: bool, init: str | None, address: str | None,
            attach: list[str], embedded: bool) -> tuple[int, str, list[str]]:
    import subprocess

    cmd = [sys.executable, "-m", "mixfleet.ui.cli", "run", str(plan), "--out", str(folder / RUN_SUBDIR),
           "--updates", str(updates), "--quiet"]
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
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with (folder / LOG_FILE).open("ab") as log:
        log.write(f"\n[{_utc()}] mixfleet ui: {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(folder), env=env, start_new_session=True)
    start = None
    for _ in range(50):                      # /proc entry appears at once; be patient on a loaded machine
        start = _pid_start(proc.pid)
        if start is not None:
            break
        time.sleep(0.02)
    if start is None:
        code = proc.poll()
        raise RunManagerError(f"mixfleet run exited at once (code {code}); see {folder / LOG_FILE}")
    return proc.pid, start, cmd


def parse_plan(plan_text: str) -> Any:
    """The plan as data only: TOML parsed and validated by `policies.plan`, no file read (a `base` is refused:
    the pages hand over complete plans). Raises SpecError naming the field."""
    import tomllib

    from mixfleet.costmodel.errors import SpecError
    from mixfleet.policies.plan import plan_from_dict

    try:
        raw = tomllib.loads(plan_text)
    except tomllib.TOMLDecodeError as e:
        raise SpecError(PLAN_FILE, "<file>", "not TOML", f"valid TOML ({e})") from None
    if "base" in raw:
        raise SpecError(PLAN_FILE, "base", raw["base"], "a complete plan (no base): the app runs the plan it shows")
    return plan_from_dict(raw)


def start(root: str | Path, name: str, plan_text: str, updates: int, *, init: str | None = None,
          address: str | None = None, attach: list[str] | None = None, embedded: bool = True) -> ManagedRun:
    """Start `mixfleet run` on `plan_text` in RUNS/<name>, in the background.

    Refuses a folder that holds anything already (another managed run, a run log, or files of the user's):
    resume it instead, or pick another name. The plan is parsed and validated here first (as data only:
    `base` must name a shipped plan), so a bad plan is an error on the page, not a dead process.
    """
    if not 1 <= int(updates) <= MAX_UPDATES:
        raise RunManagerError(f"updates {updates}: allowed 1..{MAX_UPDATES}")
    if len(plan_text.encode()) > MAX_PLAN_BYTES:
        raise RunManagerError(f"plan: {len(plan_text.encode())} bytes; allowed at most {MAX_PLAN_BYTES}")
    parse_plan(plan_text)
    folder = run_folder(root, name)
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if folder.exists():
        m = load(folder)
        if m is not None:
            what = "is running" if m.alive() else f"is {m.state()}"
            raise RunManagerError(f"run folder {folder}: a managed run {what} there; resume it, or pick another name")
        if any(folder.iterdir()):
            raise RunManagerError(f"run folder {folder}: not empty (holds another run or your files); "
                                  "pick another name")
    folder.mkdir(exist_ok=True)
    with _lock(folder):
        if load(folder) is not None:
            raise RunManagerError(f"run folder {folder}: another session just started a run there")
        plan_path = folder / PLAN_FILE
        plan_path.write_text(plan_text)
        pid, pstart, cmd = _launch(folder, plan_path, int(updates), False, init, address, attach or [], embedded)
        m = ManagedRun(folder=str(folder), pid=pid, pid_start=pstart, command=cmd, started_utc=_utc(),
                       updates=int(updates), extra={"init": init, "address": address, "attach": attach or [],
                                                    "embedded": embedded})
        _write_json(folder / MANAGED_FILE, asdict(m))
    return m


def stop(m: ManagedRun) -> None:
    """Ask the run to stop cleanly (SIGTERM: it ends after the current update, checkpointed and closed)."""
    if not m.alive():
        raise RunManagerError(f"run {m.name} is not running ({m.state()})")
    os.kill(m.pid, signal.SIGTERM)
    m.stop_requested_utc = _utc()
    _write_json(Path(m.folder) / MANAGED_FILE, asdict(m))


def kill(m: ManagedRun) -> None:
    """Kill the run at once: SIGKILL to its process group (its local Ray included). Resumable."""
    if not m.alive():
        raise RunManagerError(f"run {m.name} is not running ({m.state()})")
    with contextlib.suppress(ProcessLookupError):
        os.killpg(m.pid, signal.SIGKILL)
    m.killed_utc = _utc()
    _write_json(Path(m.folder) / MANAGED_FILE, asdict(m))
    for _ in range(100):                     # reaped by init (new session); wait until it is gone
        if not m.alive():
            break
        time.sleep(0.05)


def resume(m: ManagedRun, updates: int | None = None) -> ManagedRun:
    """Continue a stopped, killed or crashed managed run (`mixfleet run ... --resume`), optionally to more updates."""
    folder = Path(m.folder)
    target = int(updates if updates is not None else m.updates)
    if not 1 <= target <= MAX_UPDATES:
        raise RunManagerError(f"updates {target}: allowed 1..{MAX_UPDATES}")
    with _lock(folder):
        cur = load(folder) or m
        if cur.alive():
            raise RunManagerError(f"run {m.name} is running; stop it before resuming")
        if not (cur.run_dir / "run.json").exists():
            raise RunManagerError(f"run {m.name}: no run log to resume in {cur.run_dir}; start it anew")
        ex = cur.extra or {}
        pid, pstart, cmd = _launch(folder, folder / PLAN_FILE, target, True, ex.get("init"), ex.get("address"),
                                   list(ex.get("attach") or []), bool(ex.get("embedded", True)))
        new = ManagedRun(folder=str(folder), pid=pid, pid_start=pstart, command=cmd, started_utc=_utc(),
                         updates=target, resumes=cur.resumes + 1, extra=ex)
        _write_json(folder / MANAGED_FILE, asdict(new))
    return new


def progress(m: ManagedRun, predicted_s_per_update: float | None = None, updates: Any = None) -> dict[str, Any]:
    """Updates done / target, elapsed wall seconds, and an ETA (the twin's time per update if given, else
    the run's own measured pace). `updates`: the run log's updates frame if the caller has read it already
    (the Runs page has, cached); else it is read here."""
    import pandas as pd

    done, elapsed = 0, None
    if updates is None:
        from mixfleet.costmodel.runlog import RunLog

        with contextlib.suppress(Exception):
            updates = RunLog.open(m.run_dir).updates
    if updates is not None and len(updates):
        done = int(pd.to_numeric(updates["version"], errors="coerce").max())
        elapsed = float(pd.to_numeric(updates["end_s"], errors="coerce").max())
    remaining = max(0, m.updates - done)
    eta, basis = None, None
    if remaining and predicted_s_per_update and predicted_s_per_update > 0:
        eta, basis = remaining * predicted_s_per_update, "twin"
    elif remaining and done and elapsed:
        eta, basis = remaining * elapsed / done, "measured pace"
    return {"done": done, "target": m.updates, "elapsed_s": elapsed, "eta_s": eta, "eta_basis": basis}
