"""One sandbox: a private copy of a folder, and commands run on it inside bubblewrap.

How (docs/sandbox.md says why):
- Every `exec` is one `bwrap` process: `--unshare-all` (fresh user, mount, PID, network, IPC, UTS, cgroup
  namespaces: no network at all), `--die-with-parent`, `--new-session`; the host's /usr read-only (+ the /bin,
  /lib, /lib64 symlinks), a minimal /etc (passwd, group, the loader cache), `--proc`, `--dev`, a size-capped
  tmpfs /tmp, and the copy bound read-write at /work/repo, the only writable place. /root, /home, /work and the
  host's /tmp are never bound.
- Run as root, the host side drops to an unprivileged uid (`SANDBOX_UID`, nobody) before bwrap starts, so that
  inside a fresh user namespace RLIMIT_NPROC applies (root is exempt from it) and counts only this sandbox's
  processes. The limits are set inside by util-linux `prlimit` right before `bash -c CMD`.
- The copy lives on a tmpfs of `disk_mb` mounted by the host (as root); not root, the copy is a plain folder
  whose size is checked after each command (weaker; docs/sandbox.md).
- Time: the bwrap process is killed (SIGKILL to its process group); bwrap's PID namespace init then dies and
  takes every process of the sandbox with it. Output: read in chunks, the first `output_bytes` kept, the rest
  read and dropped.
- A marker (owner pid + its start time) sits in the sandbox's runtime folder so `mixfleet cleanup` can remove
  sandboxes of a killed driver (runtime.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixfleet.runner.rollout.sandbox import runtime
from mixfleet.runner.rollout.sandbox.patch import tree_diff

BWRAP = "/usr/bin/bwrap"
PRLIMIT = "/usr/bin/prlimit"
INSTALL = "install it with `apt-get install bubblewrap`"
SANDBOX_UID = 65534                  # nobody: the host uid sandboxes run as when mixfleet runs as root
INSIDE = "/work/repo"                # the copy, as seen inside (cwd of every command)
PATH = "/usr/local/bin:/usr/bin:/bin"
_ETC = ("/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/ld.so.cache", "/etc/ld.so.conf",
        "/etc/ld.so.conf.d", "/etc/localtime", "/etc/python3", "/etc/python3.11", "/etc/alternatives")
_PIPE_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Limits of one sandbox; every command gets them afresh."""

    timeout_s: float = 10.0          # wall-clock seconds per command (whole process tree killed after it)
    cpu_s: int = 10                  # RLIMIT_CPU seconds per process
    memory_mb: int = 512             # RLIMIT_AS (address space) MiB per process
    max_procs: int = 64              # RLIMIT_NPROC: processes at once inside the sandbox (its own user namespace)
    file_size_mb: int = 16           # RLIMIT_FSIZE MiB: largest file a process may write
    disk_mb: int = 64                # MiB of the writable copy (its tmpfs size); also the private /tmp's size
    output_bytes: int = 65536        # bytes of stdout+stderr kept per command; the rest is read and dropped

    def __post_init__(self) -> None:
        ranges: dict[str, tuple[float, float]] = {
            "timeout_s": (0.01, 86400), "cpu_s": (1, 86400), "memory_mb": (16, 1 << 20), "max_procs": (4, 1 << 16),
            "file_size_mb": (1, 1 << 20), "disk_mb": (1, 1 << 20), "output_bytes": (1, 1 << 30)}
        for name, (lo, hi) in ranges.items():
            v = getattr(self, name)
            is_int = name != "timeout_s"
            ok = isinstance(v, int if is_int else (int, float)) and not isinstance(v, bool) and lo <= v <= hi
            if not ok:
                kind = "an integer" if is_int else "a number"
                raise ValueError(f"SandboxLimits.{name}={v!r}: must be {kind} in [{lo:g}, {hi:g}]")


@dataclass(frozen=True, kw_only=True)
class ExecResult:
    """What one command did."""

    exit_code: int                   # the command's exit code; 124 on timeout, 128+N on signal N
    output: str                      # stdout and stderr interleaved (utf-8, errors replaced), at most output_bytes
    truncated: bool                  # True when output was cut at output_bytes
    elapsed_s: float                 # wall seconds of the whole bwrap process
    timed_out: bool = False


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create its namespaces (one line, naming the install step)."""


def _as_root() -> bool:
    return os.geteuid() == 0


def _user_kwargs() -> dict[str, Any]:
    """Popen arguments that run bwrap as the unprivileged sandbox uid when we are root."""
    if _as_root():
        return {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}
    return {}


def bwrap_argv(copy: Path, cmd: str, limits: SandboxLimits) -> list[str]:
    """The full command line of one sandboxed command."""
    argv = [BWRAP, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for link in ("/bin", "/lib", "/lib64", "/sbin"):
        if os.path.islink(link):
            argv += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            argv += ["--ro-bind", link, link]
    argv += ["--dir", "/etc"]
    for path in _ETC:
        argv += ["--ro-bind-try", path, path]
    mib = 1 << 20
    size = str(limits.disk_mb * mib)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--size", size, "--tmpfs", "/tmp", "--bind", str(copy), INSIDE, "--remount-ro", "/",
             "--chdir", INSIDE, "--clearenv",
             "--setenv", "PATH", PATH, "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
             "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "TERM", "dumb"]
    # CPU: SIGXCPU at cpu_s (exit 152), SIGKILL one second later if it is caught
    argv += [PRLIMIT, f"--nproc={limits.max_procs}", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
             f"--as={limits.memory_mb * mib}", f"--fsize={limits.file_size_mb * mib}", "--core=0", "--",
             "/bin/bash", "-c", cmd]
    return argv


@functools.lru_cache(maxsize=1)
def _check() -> str | None:
    if not os.path.exists(BWRAP):
        return f"bubblewrap ({BWRAP}) is missing: {INSTALL}"
    if not os.path.exists(PRLIMIT):
        return f"prlimit ({PRLIMIT}) is missing: install it with `apt-get install util-linux`"
    home = runtime.new_dir("probe")
    probe = home / "repo"
    try:
        probe.mkdir(mode=0o777)
        os.chmod(probe, 0o777)
        argv = bwrap_argv(probe, "exit 0", SandboxLimits())
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=60, **_user_kwargs())
        except (OSError, subprocess.SubprocessError) as e:
            return f"bubblewrap cannot start ({e}): {INSTALL}"
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["no message"])[-1]
            return f"bubblewrap cannot create its namespaces ({why}): {INSTALL} and allow user namespaces"
        return None
    finally:
        runtime.remove(home)


def check_sandbox() -> None:
    """Raise SandboxUnavailable (one line) if sandboxes cannot run here; the probe runs once per process."""
    why = _check()
    if why is not None:
        raise SandboxUnavailable(why)


def _chown_tree(root: Path) -> None:
    """Give the copy to the sandbox uid (files the host wrote into it since the last command included)."""
    if not _as_root():
        return
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            try:
                if os.lstat(name).st_uid != SANDBOX_UID:
                    os.lchown(name, SANDBOX_UID, SANDBOX_UID)
            except FileNotFoundError:
                pass


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(root):
        for n in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class _CappedOutput(asyncio.Protocol):
    """Keeps the first `cap` bytes of a pipe and drops the rest as it arrives (memory stays bounded)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.kept = bytearray()
        self.truncated = False
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        room = self.cap - len(self.kept)
        if room > 0:
            self.kept += data[:room]
        if len(data) > room:
            self.truncated = True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _output_pipe(cap: int) -> tuple[int, asyncio.ReadTransport, _CappedOutput]:
    """A pipe for a command's stdout + stderr: the write end's fd, and the transport + protocol reading the other.
    The pipe is enlarged (1 MiB where allowed) so that a flood of output costs fewer wake-ups."""
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
    except OSError:
        pass
    proto = _CappedOutput(cap)
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(lambda: proto, os.fdopen(r, "rb", buffering=0))
    return w, transport, proto


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Sandbox:
    """A private copy of `source` and the sandboxed commands run on it (see the module docstring)."""

    def __init__(self, source: Path, limits: SandboxLimits, home: Path) -> None:
        self.source = source
        self.limits = limits
        self.home = home                      # the runtime folder: marker + the copy
        self.workdir = home / "repo"          # host path of the writable copy
        self.start_s = 0.0
        self.exec_count = 0
        self.exec_s_total = 0.0
        self._mounted = False
        self._closed = False
        self._procs: set[asyncio.subprocess.Process] = set()

    @classmethod
    async def create(cls, source: Path, *, limits: SandboxLimits | None = None) -> Sandbox:
        """A fresh copy of the folder `source` becomes the only writable folder, /work/repo inside."""
        t0 = time.perf_counter()
        source = Path(source)
        if not source.is_dir():
            raise ValueError(f"Sandbox source={str(source)!r}: must be an existing folder")
        check_sandbox()
        limits = limits or SandboxLimits()
        box = cls(source, limits, runtime.new_dir("box"))
        try:
            await asyncio.to_thread(box._prepare)
        except BaseException:
            await box.close()
            raise
        box.start_s = time.perf_counter() - t0
        return box

    def _prepare(self) -> None:
        self.workdir.mkdir()
        if _as_root():
            opts = f"size={self.limits.disk_mb}m,mode=0755,uid={SANDBOX_UID},gid={SANDBOX_UID}"
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "mixfleet-sandbox", str(self.workdir)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise SandboxUnavailable(f"cannot mount the sandbox's tmpfs ({r.stderr.strip()}): run as root "
                                         "with CAP_SYS_ADMIN, or as a user (the disk cap is then a check)")
            self._mounted = True
            runtime.write_marker(self.home, mounted=True)
        try:
            shutil.copytree(self.source, self.workdir, symlinks=True, dirs_exist_ok=True)
        except (shutil.Error, OSError) as e:
            raise ValueError(f"Sandbox source={str(self.source)!r}: cannot copy it into {self.limits.disk_mb} MiB "
                             f"(disk_mb): {str(e)[:200]}") from None
        _chown_tree(self.workdir)

    async def exec(self, cmd: str, timeout_s: float | None = None) -> ExecResult:
        """Run `bash -c cmd` inside (cwd /work/repo) under the limits; never raises for what the command does."""
        if self._closed:
            raise RuntimeError("Sandbox.exec: the sandbox is closed")
        timeout = self.limits.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise ValueError(f"Sandbox.exec timeout_s={timeout_s!r}: must be > 0")
        await asyncio.to_thread(_chown_tree, self.workdir)
        t0 = time.perf_counter()
        w, transport, out = await _output_pipe(self.limits.output_bytes)
        try:
            proc = await asyncio.create_subprocess_exec(
                *bwrap_argv(self.workdir, cmd, self.limits), stdin=asyncio.subprocess.DEVNULL, stdout=w, stderr=w,
                start_new_session=True, **_user_kwargs())
        except BaseException:
            transport.close()
            raise
        finally:
            os.close(w)
        self._procs.add(proc)
        runtime.add_pid(self.home, proc.pid)
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except TimeoutError:
            timed_out = True
            _kill_group(proc)
            await proc.wait()
        finally:
            if proc.returncode is None:       # cancelled: leave nothing behind
                _kill_group(proc)
                transport.close()
                await proc.wait()
            self._procs.discard(proc)
            runtime.drop_pid(self.home, proc.pid)
        # bwrap is gone, so its PID namespace is too: the pipe closes once the reader has drained it
        try:
            await asyncio.wait_for(asyncio.shield(out.done), 10.0)
        except TimeoutError:
            out.truncated = True
        transport.close()
        data, truncated = bytes(out.kept), out.truncated
        elapsed = time.perf_counter() - t0
        code = 124 if timed_out else proc.returncode
        code = 128 - code if code < 0 else code
        text = data.decode("utf-8", errors="replace")
        if timed_out:
            text += f"\n[timed out after {timeout:g} s: every process of the command was killed]"
        if not self._mounted and _tree_bytes(self.workdir) > self.limits.disk_mb << 20:
            text += f"\n[the work folder is over its {self.limits.disk_mb} MiB disk cap]"
            code = code or 1
        self.exec_count += 1
        self.exec_s_total += elapsed
        return ExecResult(exit_code=code, output=text, truncated=truncated, elapsed_s=elapsed, timed_out=timed_out)

    async def diff(self) -> str:
        """Unified diff (a/REL, b/REL) of the work copy against `source`; "" if unchanged."""
        return await asyncio.to_thread(tree_diff, self.source, self.workdir)

    async def close(self) -> None:
        """Kill anything left, delete the copy; idempotent."""
        if self._closed:
            return
        self._closed = True
        for proc in list(self._procs):
            _kill_group(proc)
        for proc in list(self._procs):
            await proc.wait()
        await asyncio.to_thread(runtime.remove, self.home)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
