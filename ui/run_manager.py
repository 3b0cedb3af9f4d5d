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

Nothing in managed.json is taken on trust (it is a file in a folder others can write or copy):
- the app signs each record it writes (HMAC-SHA256 with a key of its own, `<state>/ui/managed-runs.key`,
  mode 0600; state = $MIXFLEET_STATE_DIR or ~/.cache/mixfleet), and the record names the folder it was
  written in: a hand-written record, an edited one, or one copied into another folder is no managed run;
- a process is this run's only while `/proc` shows it is: this user's, its command line is
  `python -m mixfleet.ui.cli run <this folder>/plan.toml --out <this folder>/run ...`, and its start time is
  the recorded one (so a reused pid is never taken for it); Kill also needs it to lead its own process group;
- Resume builds the command line itself (`_launch`), from the signed record's checked launch options; the
  record's `command` is shown, never run. A plan's spec files are copied into the run folder
  (`self_contained_plan`), since `mixfleet run` reads specs only beside the plan.
A run that exits is reaped by a thread of the app (it stayed a `<defunct>` child of the app otherwise).

Stop is clean: SIGTERM, on which `mixfleet run` finishes the update it is on, checkpoints and closes its
run log with status "stopped" (resumable). Kill is SIGKILL to the run's process group (its local Ray
included); the run log stays readable and `--resume` continues from the last checkpoint.

How far a run is and its ETA (`progress`) are in ui/run_progress.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.ui.run_progress import progress

MANAGED_FILE = "managed.json"
PLAN_FILE = "plan.toml"
LOG_FILE = "driver.log"
RUN_SUBDIR = "run"
LOCK_FILE = ".managed.lock"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_PLAN_BYTES = 1 << 20          # a plan file is small; refuse anything bigger
MAX_UPDATES = 100_000
LOG_TAIL_BYTES = 16_384
KEY_FILE = Path("ui") / "managed-runs.key"   # under the state folder (runner/orchestration/local_ray.state_dir)
SIGNATURE = "signature"
SPEC_FIELDS = {"model": "models", "workload": "workloads"}   # plan field -> shipped data folder


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
    done_at_launch: int = 0        # updates the run log held when this process was started (a resume's start)
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
        """True while the process that this record names is this run's `mixfleet run`: same pid, same start
        time, this user's, and its command line is this folder's (`is_run_process`)."""
        return bool(self.pid_start) and _pid_start(self.pid) == self.pid_start \
            and is_run_process(self.pid, Path(self.folder))

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


def _argv(pid: int) -> list[str] | None:
    """The command line of process `pid` as /proc shows it (None if there is none or it cannot be read)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [a.decode("utf-8", errors="surrogateescape") for a in raw.split(b"\0")[:-1]]


def run_argv(folder: str | Path) -> list[str]:
    """The start of every command line the app runs for the run in `folder` (and the one it looks for): the
    launcher's `mixfleet run` command line (runner/orchestration/launcher.py `run_argv`)."""
    from mixfleet.runner.orchestration.launcher import run_argv as launcher_argv

    folder = Path(folder)
    return launcher_argv(folder / PLAN_FILE, folder / RUN_SUBDIR, quiet=False)


def is_run_process(pid: int, folder: str | Path) -> bool:
    """Whether process `pid` is, by /proc, the `mixfleet run` of the run in `folder`: this user's, a Python
    interpreter running `-m mixfleet.ui.cli run <folder>/plan.toml --out <folder>/run`. Nothing a file says counts."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
    except OSError:
        return False
    argv = _argv(pid)
    want = run_argv(folder)
    return bool(argv) and len(argv) >= len(want) and Path(argv[0]).name.startswith("python") \
        and argv[1:len(want)] == want[1:]


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def _key(create: bool) -> bytes | None:
    """The app's key for signing managed.json (made on first use, mode 0600), or None if there is none yet."""
    from mixfleet.runner.orchestration.local_ray import state_dir

    path = state_dir() / KEY_FILE
    for _ in range(40):
        try:
            data = path.read_bytes()
            if len(data) >= 32:
                return data
        except FileNotFoundError:
            pass
        except OSError as e:
            raise RunManagerError(f"cannot read the app's record key {path} ({e}); set MIXFLEET_STATE_DIR to a "
                                  "folder of your own") from None
        if not create:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            time.sleep(0.05)                 # another session is writing it: read it
            continue
        except OSError as e:
            raise RunManagerError(f"cannot write the app's record key {path} ({e}); set MIXFLEET_STATE_DIR to a "
                                  "writable folder") from None
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
    raise RunManagerError(f"the app's record key {path} is unreadable or too short; delete it (its runs are "
                          "then followed, no longer controlled)")


def _signature(key: bytes, data: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in data.items() if k != SIGNATURE}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def save(m: ManagedRun) -> None:
    """Write `m` as RUNS/<name>/managed.json, signed with the app's key (the only way a record is written)."""
    data = asdict(m)
    key = _key(create=True)
    assert key is not None
    data[SIGNATURE] = _signature(key, data)
    _write_json(Path(m.folder) / MANAGED_FILE, data)


def _reap(proc: Any) -> None:
    """Wait for a launched run in a thread of its own, so that it never stays a zombie child of the app."""
    threading.Thread(target=proc.wait, name=f"mixfleet-reap-{proc.pid}", daemon=True).start()


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
def load_checked(folder: str | Path) -> tuple[ManagedRun | None, str | None]:
    """(the managed run in `folder`, None), or (None, why not): no managed.json, unreadable, not signed by this
    app (hand-written or edited), or signed for another folder (a copy). None, None when there is no record."""
    p = Path(folder) / MANAGED_FILE
    if not p.is_file():
        return None, None
    try:
        if p.stat().st_size > MAX_PLAN_BYTES:
            return None, f"{p}: {p.stat().st_size} bytes, not a record of this app"
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        return None, f"{p}: unreadable ({e})"
    if not isinstance(data, dict):
        return None, f"{p}: not a record of this app"
    try:
        key = _key(create=False)
    except RunManagerError as e:
        return None, str(e)
    sig = data.get(SIGNATURE)
    if key is None or not isinstance(sig, str) or not hmac.compare_digest(sig, _signature(key, data)):
        return None, (f"{p} was not written by this app (its signature does not match): the run is followed, "
                      "never stopped, killed or resumed from here")
    try:
        m = ManagedRun(**{k: data[k] for k in ManagedRun.__dataclass_fields__ if k in data})
    except TypeError as e:
        return None, f"{p}: not a record of this app ({e})"
    here = Path(folder).resolve()
    if not isinstance(m.folder, str) or Path(m.folder).resolve() != here:
        return None, (f"{p} was written for {m.folder}, not this folder {here} (copied or moved): the run is "
                      "followed, never stopped, killed or resumed from here")
    if not (isinstance(m.pid, int) and m.pid > 0 and isinstance(m.pid_start, str) and isinstance(m.updates, int)
            and isinstance(m.resumes, int) and isinstance(m.extra, dict)):
        return None, f"{p}: not a record of this app (fields of the wrong type)"
    return m, None


def load(folder: str | Path) -> ManagedRun | None:
    """The managed run in `folder`, or None if the app did not start one there (see `load_checked`)."""
    return load_checked(folder)[0]


def refusal(folder: str | Path) -> str | None:
    """Why the managed.json in `folder` is not taken as a run of this app (None: there is none, or it is)."""
    return load_checked(folder)[1]


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


TRACKERS = ("tensorboard", "wandb")   # `mixfleet run --tracker` (costmodel/records/trackers.py TRACKERS)


def _options(extra: Any) -> tuple[str | None, str | None, list[str], bool, list[str]]:
    """The launch options of a record (init, address, attach, embedded, trackers), each checked for its type."""
    ex = extra if isinstance(extra, dict) else {}
    trackers = ex.get("trackers") or []
    if not (isinstance(trackers, list) and all(t in TRACKERS for t in trackers)):
        raise RunManagerError(f"launch option trackers = {trackers!r}: allowed a list of {', '.join(TRACKERS)}")
    init, address = ex.get("init"), ex.get("address")
    attach, embedded = ex.get("attach") or [], ex.get("embedded", True)
    for name, v in (("init", init), ("address", address)):
        if v is not None and not (isinstance(v, str) and v and not v.startswith("-")):
            raise RunManagerError(f"launch option {name} = {v!r}: allowed none or a path / address")
    if not (isinstance(attach, list) and all(isinstance(a, str) and "=" in a and not a.startswith("-")
                                             for a in attach)):
        raise RunManagerError(f"launch option attach = {attach!r}: allowed a list of GROUP=URL")
    if not isinstance(embedded, bool):
        raise RunManagerError(f"launch option embedded = {embedded!r}: allowed true or false")
    return init, address, list(attach), embedded, list(trackers)


def _launch(folder: Path, updates: int, resume: bool, init: str | None, address: str | None,
            attach: list[str], embedded: bool, trackers: list[str] | None = None) -> tuple[int, str, list[str]]:
    """Start the run in `folder` as a child through the launcher; (pid, its /proc start time, the command).
    Each tracker streams to its default place (RUNS/tensorboard/<name>, RUNS/wandb: trackers.default_dest)."""
    from mixfleet.runner.orchestration import launcher

    cmd = launcher.run_argv(folder / PLAN_FILE, folder / RUN_SUBDIR, updates=updates, resume=resume, init=init,
                            address=address, attach=attach, embedded=embedded)
    for t in trackers or []:
        cmd += ["--tracker", t]
    proc = launcher.start_child(cmd, log_path=folder / LOG_FILE, cwd=folder,
                                banner=f"[{_utc()}] mixfleet ui: {' '.join(cmd)}")
    _reap(proc)
    start = None
    for _ in range(250):                     # be patient on a loaded machine: the /proc entry appears at once,
        start = _pid_start(proc.pid)         # the command line a moment after (the kernel sets the new argv up
        if start is not None and is_run_process(proc.pid, folder):   # after Popen already saw the exec)
            break
        start = None
        time.sleep(0.02)
    if start is None:
        # running, but /proc does not show it as this run's: the app could never stop it, so it is not kept
        if proc.returncode is None and _pid_start(proc.pid) is not None:
            from mixfleet.runner.orchestration.launcher import kill_child

            kill_child(proc.pid)
            raise RunManagerError(f"the launched process {proc.pid} does not show the command line {cmd[:7]} in "
                                  "/proc, so the app could never stop it; killed it")
        raise RunManagerError(f"mixfleet run exited at once (code {proc.returncode}); see {folder / LOG_FILE}")
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


def self_contained_plan(plan_text: str, root: str | Path, folder: str | Path) -> str:
    """The plan as the run folder's plan.toml: a model / workload given as a spec file (the Plan page's edited
    specs, RUNS/ui-specs/...) must lie inside the runs folder; it is copied into `folder` as model.toml /
    workload.toml and named so (`mixfleet run` reads specs only beside its plan). Shipped names stay."""
    import tomllib

    import tomli_w

    copies = _spec_files(plan_text, root)
    if not copies:
        return plan_text
    raw = tomllib.loads(plan_text)
    for key, src in copies.items():
        dst = Path(folder) / f"{key}.toml"
        dst.write_bytes(src.read_bytes())
        raw[key] = dst.name
    return tomli_w.dumps(raw)


def _spec_files(plan_text: str, root: str | Path) -> dict[str, Path]:
    """The spec files a plan names (field -> resolved path), each checked to be a .toml file inside the runs
    folder; shipped names are left out. A SpecError names the field, the value and what is allowed."""
    import tomllib

    from mixfleet.costmodel.errors import SpecError
    from mixfleet.costmodel.paths import is_shipped_ref, shipped_names

    raw = tomllib.loads(plan_text)
    root_r = Path(root).resolve()
    out: dict[str, Path] = {}
    for key, data_folder in SPEC_FIELDS.items():
        ref = raw.get(key)
        if not isinstance(ref, str) or is_shipped_ref(ref):
            continue
        src = Path(ref)
        src = (src if src.is_absolute() else root_r / src).resolve()
        if Path(ref).suffix != ".toml" or not src.is_relative_to(root_r) or not src.is_file():
            raise SpecError(f"plan '{raw.get('name')}'", key, ref,
                            f"a shipped {key} name ({', '.join(shipped_names(data_folder))}) or a .toml file inside "
                            f"the runs folder {root_r} (the Plan page's edited specs)")
        out[key] = src
    return out


def start(root: str | Path, name: str, plan_text: str, updates: int, *, init: str | None = None,
          address: str | None = None, attach: list[str] | None = None, embedded: bool = True,
          trackers: list[str] | None = None) -> ManagedRun:
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
    _spec_files(plan_text, root)            # a spec outside the runs folder: refused before anything is made
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
        plan_path.write_text(self_contained_plan(plan_text, root, folder))
        extra = {"init": init, "address": address, "attach": list(attach or []), "embedded": embedded,
                 "trackers": list(trackers or [])}
        opts = _options(extra)
        _key(create=True)                   # no key, no record: fail before a process is started
        pid, pstart, cmd = _launch(folder, int(updates), False, *opts)
        m = ManagedRun(folder=str(folder), pid=pid, pid_start=pstart, command=cmd, started_utc=_utc(),
                       updates=int(updates), extra=extra)
        save(m)
    return m


def _mark(m: ManagedRun, **changes: str) -> None:
    """Note a stop or kill in the folder's own record (when it is the app's, for this very process)."""
    cur = load(m.folder)
    if cur is not None and cur.pid == m.pid and cur.pid_start == m.pid_start:
        for k, v in changes.items():
            setattr(cur, k, v)
        save(cur)
    for k, v in changes.items():
        setattr(m, k, v)


def stop(m: ManagedRun) -> None:
    """Ask the run to stop cleanly (SIGTERM: it ends after the current update, checkpointed and closed)."""
    from mixfleet.runner.orchestration.launcher import stop_child

    if not m.alive():                        # this folder's `mixfleet run`, by /proc, or nothing is signalled
        raise RunManagerError(f"run {m.name} is not running ({m.state()})")
    stop_child(m.pid)
    _mark(m, stop_requested_utc=_utc())


def kill(m: ManagedRun) -> None:
    """Kill the run at once: SIGKILL to its process group (its local Ray included). Resumable."""
    from mixfleet.runner.orchestration.launcher import kill_child

    if not m.alive():                        # this folder's `mixfleet run`, by /proc, or nothing is signalled
        raise RunManagerError(f"run {m.name} is not running ({m.state()})")
    try:                                     # launched in a session of its own: it leads its process group
        kill_child(m.pid)
    except RuntimeError as e:
        raise RunManagerError(f"run {m.name}: {e}") from None
    _mark(m, killed_utc=_utc())
    for _ in range(100):                     # reaped by the app's reaper thread (or init); wait until it is gone
        if not m.alive():
            break
        time.sleep(0.05)


def resume(m: ManagedRun, updates: int | None = None) -> ManagedRun:
    """Continue a stopped, killed or crashed managed run (`mixfleet run ... --resume`), optionally to more updates."""
    folder = Path(m.folder)
    target = int(updates if updates is not None else m.updates)
    if not 1 <= target <= MAX_UPDATES:
        raise RunManagerError(f"updates {target}: allowed 1..{MAX_UPDATES}")
    cur, why = load_checked(folder)          # the folder's own signed record, never the object handed in
    if cur is None:
        raise RunManagerError(f"run {m.name}: not a run this app started in {folder}"
                              + (f" ({why})" if why else " (no managed.json)"))
    with _lock(folder):
        cur = load(folder)
        if cur is None:
            raise RunManagerError(f"run {m.name}: not a run this app started in {folder}")
        if cur.alive():
            raise RunManagerError(f"run {m.name} is running; stop it before resuming")
        if not (cur.run_dir / "run.json").exists():
            raise RunManagerError(f"run {m.name}: no run log to resume in {cur.run_dir}; start it anew")
        opts = _options(cur.extra)
        done = progress(cur)["done"]
        pid, pstart, cmd = _launch(Path(cur.folder), target, True, *opts)
        new = ManagedRun(folder=cur.folder, pid=pid, pid_start=pstart, command=cmd, started_utc=_utc(),
                         updates=target, resumes=cur.resumes + 1, done_at_launch=done, extra=cur.extra)
        save(new)
    return new
