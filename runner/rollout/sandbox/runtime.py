"""The sandboxes' runtime folders, and the cleanup of sandboxes whose driver was killed.

Each sandbox owns `<root>/<kind>-<random>/` (root: $MIXFLEET_SANDBOX_DIR or /tmp/mixfleet-sandboxes) holding
`owner.json` (the driver's pid and start time, whether the copy is a tmpfs mount), one `pid-<N>` file per running
bwrap process, and `repo/`, the copy. `cleanup()` removes every folder whose owner is no longer alive: it kills
the bwrap processes still running on it (found by pid file and by command line), unmounts the copy, deletes the
folder, and says what it removed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import psutil


def root() -> Path:
    """The folder holding every sandbox's runtime folder."""
    return Path(os.environ.get("MIXFLEET_SANDBOX_DIR") or "/tmp/mixfleet-sandboxes")


def _start_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def new_dir(kind: str) -> Path:
    """A fresh runtime folder, marked as owned by this process (readable by the sandbox uid)."""
    base = root()
    base.mkdir(parents=True, exist_ok=True)
    os.chmod(base, 0o755)
    home = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=base))
    os.chmod(home, 0o755)
    write_marker(home, mounted=False)
    return home


def write_marker(home: Path, *, mounted: bool) -> None:
    pid = os.getpid()
    marker = {"owner_pid": pid, "owner_start": _start_time(pid), "mounted": mounted}
    tmp = home / "owner.json.tmp"
    tmp.write_text(json.dumps(marker))
    tmp.replace(home / "owner.json")


def add_pid(home: Path, pid: int) -> None:
    (home / f"pid-{pid}").touch()


def drop_pid(home: Path, pid: int) -> None:
    (home / f"pid-{pid}").unlink(missing_ok=True)


def _unmount(path: Path) -> None:
    if os.path.ismount(path):
        r = subprocess.run(["umount", str(path)], capture_output=True)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def remove(home: Path) -> None:
    """Unmount the copy and delete the runtime folder."""
    _unmount(home / "repo")
    shutil.rmtree(home, ignore_errors=True)


def _owner_alive(home: Path) -> bool:
    try:
        marker = json.loads((home / "owner.json").read_text())
    except (OSError, ValueError):
        return False
    start = _start_time(int(marker.get("owner_pid", -1)))
    return start is not None and (marker.get("owner_start") is None or abs(start - marker["owner_start"]) < 1e-3)


def _sandbox_procs(home: Path) -> list[psutil.Process]:
    """bwrap processes working on this folder's copy: by pid file, and by command line."""
    found: dict[int, psutil.Process] = {}
    copy = str(home / "repo")
    for f in home.glob("pid-*"):
        try:
            p = psutil.Process(int(f.name[4:]))
            if copy in p.cmdline():
                found[p.pid] = p
        except (ValueError, psutil.Error):
            pass
    for p in psutil.process_iter(["cmdline"]):
        if copy in (p.info.get("cmdline") or []):
            found[p.pid] = p
    return list(found.values())


def live_sandboxes() -> list[dict[str, Any]]:
    """Every runtime folder under root(): its path, whether its owner lives, its bwrap processes."""
    base = root()
    out = []
    for home in sorted(base.iterdir()) if base.is_dir() else []:
        if home.is_dir():
            out.append({"path": str(home), "owner_alive": _owner_alive(home),
                        "pids": sorted(p.pid for p in _sandbox_procs(home))})
    return out


def cleanup(*, all_owners: bool = False) -> list[dict[str, Any]]:
    """Kill and delete the sandboxes whose driver is dead (every sandbox with all_owners); returns what went."""
    removed = []
    for info in live_sandboxes():
        if info["owner_alive"] and not all_owners:
            continue
        home = Path(info["path"])
        killed = []
        for p in _sandbox_procs(home):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.kill()
                p.wait(timeout=5)
                killed.append(p.pid)
            except psutil.NoSuchProcess:
                killed.append(p.pid)
            except psutil.Error:
                pass
        remove(home)
        removed.append({"path": str(home), "killed_pids": killed, "removed": not home.exists()})
    return removed
