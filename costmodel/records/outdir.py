"""May I write here? The one check every command that writes an output folder makes first.

A destination is fine when it does not exist or is an empty folder. A folder that already holds
something is refused (never silently replaced or appended to) unless:

- it is a run of the same kind and the command continues it (`--resume`, `mixfleet run` only), or
- it is recognisably mixfleet's own output (a run, a twin run log, a checkpoint) and the user passed
  `--force`: then it is replaced.

A folder that holds anything mixfleet did not write (an unknown file name, a run.json of another format)
is never replaced, `--force` or not: mixfleet deletes only what it wrote. A path that is a file is refused.
The kinds are recognised by their marker file and by holding only the names that kind writes (below; the
writers are costmodel/records/runlog_writer.py, runner/orchestration and runner/checkpoint).

Temp names: a writer killed mid-write leaves its temp name behind. Only mixfleet's own are ignored here (and
removed by --force): `.run.json.<8 hex>.tmp` (runlog_writer.py), and for the trainer state `.trainer_state.<8 random>`
(tempfile.mkdtemp of `Trainer.save_state`), `.trainer_state.old.<pid>` (`replace_dir_atomically`) and the
checkpoint's staging folder `.trainer_state.next` with the same two forms of its own; a folder-form temp
counts only while it holds nothing but trainer-state files. Anything else, `.draft.old.1` included, is the
user's.

One writer per run folder: `lock_output_dir` takes an flock on `LOCK_FILE` inside it for as long as the
run lasts (re-entrant within a process); a second writer is refused with the pid that holds it.

No torch, no mixfleet imports but errors: this module is part of costmodel/.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError

RUNLOG_ENTRIES = frozenset({"run.json", "trajectories", "updates", "groups", "events"})
# a real run folder also holds the trainer's state and the exported weights (runner/orchestration) and
# a driver log (studies/ablation.py)
RUN_ENTRIES = RUNLOG_ENTRIES | {"trainer_state", "weights", "driver.log", "node_cache"}
CHECKPOINT_ENTRIES = frozenset({"config.json", "model.safetensors", "tokenizer.json", "pretrain.json"})
LOCK_FILE = ".mixfleet.lock"                  # a run folder's writer lock (lock_output_dir); never removed
# what a trainer-state folder holds (runner/trainer Trainer.save_state + the orchestrator's own file)
STATE_FILES = frozenset({"trainer_state.pt", "trainer_meta.json", "orchestrator.json", ".orchestrator.json.tmp"})
STAGING_SUFFIX = ".next"                      # `.trainer_state.next`: a checkpoint being put together
_RAND = r"[a-z0-9_]{8}"                       # tempfile.mkdtemp's random part (tempfile._RandomNameSequence)
_JSON_TMP = re.compile(r"^\.(run\.json)\.[0-9a-f]{8}\.tmp$")                     # runlog_writer._write_json_atomic
_DIR_TMP = re.compile(rf"^\.(trainer_state|\.trainer_state\.next)\.(?:old\.(\d+)|({_RAND}))$")
_STAGING = f".trainer_state{STAGING_SUFFIX}"


def temp_form(name: str) -> tuple[str, str] | None:
    """(entry, form) of one of mixfleet's own temp names: form "old" (`.E.old.<pid>`, an old folder set aside
    by `replace_dir_atomically`), "tmp" (a temp file or `mkdtemp` folder of a writer), "staging" (the
    checkpoint's `.trainer_state.next`); entry is the name it stands in for (`trainer_state`,
    `.trainer_state.next`, `run.json`). None for any other name."""
    if name == _STAGING:
        return "trainer_state", "staging"
    if m := _JSON_TMP.match(name):
        return m.group(1), "tmp"
    if m := _DIR_TMP.match(name):
        return m.group(1), "old" if m.group(2) is not None else "tmp"
    return None


def is_our_temp(path: Path) -> bool:
    """Is `path` a temp name mixfleet's writers leave when killed? A folder form also must hold only
    trainer-state files (or nothing, or the staging folder's own temps): a user's `.trainer_state.mybackup`
    with other files in it is the user's."""
    form = temp_form(path.name)
    if form is None:
        return False
    if form[0] == "run.json":
        return path.is_file() and not path.is_symlink()
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        names = {p.name for p in path.iterdir()}
    except OSError:
        return False
    return names <= STATE_FILES


def _header(path: Path) -> dict[str, Any] | None:
    try:
        h = json.loads((path / "run.json").read_text())
    except (OSError, ValueError):
        return None
    return h if isinstance(h, dict) and h.get("format") == "mixfleet-runlog" else None


def _is_checkpoint(path: Path) -> bool:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "mixfleet_weight_version" in cfg


@dataclass(frozen=True)
class OutputKind:
    """What a command writes: recognised by `marker` and by holding only `entries` (plus our temp names)."""

    name: str
    label: str                                  # for messages: "a run", "a twin run log", "a checkpoint"
    entries: frozenset[str]
    marker: Callable[[Path], bool]
    resumable: bool = False


KINDS: dict[str, OutputKind] = {k.name: k for k in (
    OutputKind("run", "a run (mixfleet run)", RUN_ENTRIES,
               lambda p: (_header(p) or {}).get("source") == "runner", resumable=True),
    OutputKind("twin_runlog", "a twin run log (mixfleet simulate)", RUNLOG_ENTRIES,
               lambda p: (_header(p) or {}).get("source") == "twin"),
    OutputKind("checkpoint", "a checkpoint (mixfleet init-model / pretrain)", CHECKPOINT_ENTRIES, _is_checkpoint),
)}


def _entries(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if p.name != LOCK_FILE and not is_our_temp(p)}


def classify(path: str | os.PathLike[str]) -> str | None:
    """The kind (a KINDS key) of an existing, non-empty folder mixfleet wrote; None if it is not (only) ours."""
    p = Path(path)
    names = _entries(p)
    for kind in KINDS.values():
        if names <= kind.entries and kind.marker(p):
            return kind.name
    return None


def _describe(path: Path, kind: str | None) -> str:
    if kind is None and (path / "run.json").is_file() and _header(path) is None:
        return "its run.json is not a readable mixfleet run-log header (corrupt, or another tool's)"
    if kind is None:
        names = sorted(_entries(path))
        ours = frozenset().union(*(k.entries for k in KINDS.values()))
        names = [n for n in names if n not in ours] or names    # the foreign names first: those are the reason
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return f"it holds files mixfleet did not write ({shown})"
    h = _header(path)
    run = f" {h.get('run_id')!r}, status {h.get('status')!r}" if h else ""
    return f"it already holds {KINDS[kind].label}{run}"


def prepare_output_dir(path: str | os.PathLike[str], kind: str, *, where: str, flag: str = "--out",
                       resume: bool = False, force: bool = False, clear: bool = True) -> str:
    """Check that `kind` output may be written at `path`; returns "new", "resume" or "replace".

    "new": the path does not exist or is an empty folder. "resume": `resume` and the folder holds the same
    resumable kind. "replace": `force` and the folder holds mixfleet output; when `clear`, the folder is
    removed here (callers that replace it atomically themselves pass clear=False).
    Anything else is a SpecError naming `where` (the command), `flag`, the path and what is allowed.
    """
    if kind not in KINDS:
        raise SpecError("prepare_output_dir", "kind", kind, tuple(KINDS))
    want = KINDS[kind]
    p = Path(path)
    options = ("--resume (continue it) or --force (replace it)" if want.resumable
               else "--force (replace it)")
    _check_path(p, where, flag)
    if (holder := _held_by_other(p)) is not None:
        raise SpecError(where, flag, str(p), _busy(p, holder))
    if not p.exists() or not _entries(p):
        return "new"
    try:
        found = classify(p)
    except OSError as exc:
        raise SpecError(where, flag, str(p), f"a folder mixfleet can read ({exc})") from None
    if resume:
        if not want.resumable:
            raise SpecError(where, "--resume", str(p), f"only for {KINDS['run'].label}")
        if found == kind:
            return "resume"
        raise SpecError(where, flag, str(p), f"{want.label} to continue with --resume; {_describe(p, found)}")
    if found is None:
        raise SpecError(where, flag, str(p), f"a new or empty folder; {_describe(p, found)} and --force replaces "
                                             "only a folder mixfleet wrote: choose another folder")
    if not force:
        how = options if found == kind else "--force (replace it)"
        raise SpecError(where, flag, str(p), f"a new or empty folder, or pass {how}; {_describe(p, found)}")
    if p.is_symlink():
        raise SpecError(where, flag, str(p), f"a folder, not a symbolic link, for --force ({p} points to "
                                             f"{os.path.realpath(p)}; pass that folder itself to replace it)")
    if clear:
        _clear(p)
    return "replace"


def _check_path(p: Path, where: str, flag: str) -> None:
    """A path that is a file, or lies under one (`FILE/sub`), is refused here, not by a traceback later."""
    if p.exists() and not p.is_dir():
        raise SpecError(where, flag, str(p), "a new or empty folder (this path is a file)")
    if p.is_symlink() and not p.exists():
        raise SpecError(where, flag, str(p), f"a folder (this is a link to {os.readlink(p)}, which does not exist)")
    check_parent_is_folder(p, where=where, flag=flag)


def check_parent_is_folder(p: Path, *, where: str, flag: str, what: str = "a folder path") -> None:
    """A path under a file (`FILE/sub`) is refused here, in one line, not by a NotADirectoryError later."""
    for parent in Path(p).absolute().parents:
        if parent.exists() or parent.is_symlink():
            if not parent.is_dir():
                raise SpecError(where, flag, str(p), f"{what} ({parent} is not a folder, so nothing can be "
                                                     "created under it)")
            return


def _clear(p: Path) -> None:
    """Remove what a replaced folder holds; a run folder keeps its lock file (and so stays locked by us)."""
    if not (p / LOCK_FILE).exists():
        shutil.rmtree(p)
        return
    for child in p.iterdir():
        if child.name == LOCK_FILE:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


# ---- one writer per run folder ---------------------------------------------------------------------------
_HELD: dict[str, list[Any]] = {}                 # real path of a locked folder -> [fd, holds]


@dataclass
class OutputLock:
    """This process's hold on a folder's lock (`lock_output_dir`); `release()` once per acquire."""

    path: Path
    key: str
    released: bool = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        held = _HELD.get(self.key)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del _HELD[self.key]
            with contextlib.suppress(OSError):
                os.close(held[0])            # closing the descriptor releases the flock

    def __enter__(self) -> OutputLock:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _busy(p: Path, holder: str) -> str:
    return (f"a folder no other process is writing: mixfleet pid {holder} holds its lock ({p / LOCK_FILE}); wait "
            "for that run to end or stop it, or choose another folder")


def _held_by_other(p: Path) -> str | None:
    """The pid (as written in the lock file) of another process holding `p`'s lock; None when free or ours."""
    lock = p / LOCK_FILE
    if not lock.is_file() or lock.is_symlink() or os.path.realpath(p) in _HELD:
        return None
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)     # only probes: released at once below
        except OSError:
            return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        return None
    finally:
        os.close(fd)


def lock_output_dir(path: str | os.PathLike[str], *, where: str, flag: str = "--out") -> OutputLock:
    """Take the folder's writer lock (an exclusive, non-blocking flock on `path/LOCK_FILE`; the folder is
    created if missing), held until `release()` or the process ends (a killed writer releases it with its
    last descriptor). Re-entrant within one process. Another process holding it: a SpecError naming its pid."""
    p = Path(path)
    _check_path(p, where, flag)
    try:
        p.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(p)
    except OSError as exc:
        raise SpecError(where, flag, str(p), f"a folder mixfleet can create and write ({exc})") from None
    if key in _HELD:
        _HELD[key][1] += 1
        return OutputLock(p, key)
    lock = p / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        raise SpecError(where, flag, str(p), f"a folder mixfleet can write its lock file in ({exc})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise SpecError(where, flag, str(p), _busy(p, other)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[key] = [fd, 1]
    return OutputLock(p, key)



def claim_output_dir(path: str | os.PathLike[str], kind: str, *, where: str, flag: str = "--out",
                     resume: bool = False, force: bool = False) -> OutputLock:
    """Check `path` for `kind` output, take its writer lock, and check it again under the lock (then a replaced
    folder is cleared): what every writer of a run-log folder does first (`mixfleet run`, `mixfleet simulate`),
    so two writers never both pass the check of one new folder. Returns the lock (release it when the log is
    closed); raises SpecError, the lock released."""
    prepare_output_dir(path, kind, where=where, flag=flag, resume=resume, force=force, clear=False)
    lock = lock_output_dir(path, where=where, flag=flag)
    try:
        prepare_output_dir(path, kind, where=where, flag=flag, resume=resume, force=force)
    except BaseException:
        lock.release()
        raise
    return lock

# ---- single output files and the run-log folders nothing else writes into ----------------------------------
def enclosing_run_log(path: str | os.PathLike[str]) -> Path | None:
    """The run-log folder `path` is, or lies inside (any depth: `RUN/eval.json`, `RUN/updates/x`); None when none.
    A run log is a folder whose run.json is a mixfleet run-log header (a run's or a twin's)."""
    p = Path(path).absolute()
    for d in (p, *p.parents):
        with contextlib.suppress(OSError):
            if d.is_dir() and _header(d) is not None:
                return d
    return None


def check_outside_run_logs(path: str | os.PathLike[str], *, where: str, flag: str, what: str) -> None:
    """Refuse a destination inside any run log's folder (a run log holds only what its run writes: a foreign
    file there makes `--resume` refuse it and its tables unreadable by plain readers)."""
    run = enclosing_run_log(path)
    if run is not None:
        raise SpecError(where, flag, str(path), f"{what} outside every run-log folder ({run} is a run log, which holds "
                                                f"only what its run writes): write it beside it, e.g. "
                                                f"{run.parent / (run.name + '-' + Path(path).name)}")


def prepare_output_file(path: str | os.PathLike[str], *, where: str, flag: str = "--out", force: bool = False) -> None:
    """May one output file be written at `path`? Refused (SpecError): a folder; a path under a file; a path
    inside a run log's folder; an existing file without `force` (never silently replaced)."""
    p = Path(path)
    if p.is_dir():
        raise SpecError(where, flag, str(p), "a file path (this is a folder)")
    check_parent_is_folder(p, where=where, flag=flag, what="a file path")
    check_outside_run_logs(p, where=where, flag=flag, what="a file")
    if (p.exists() or p.is_symlink()) and not force:
        raise SpecError(where, flag, str(p), "a new file, or pass --force to replace it (it already exists)")
