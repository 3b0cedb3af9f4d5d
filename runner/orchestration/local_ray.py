"""The local Ray of a run: bound to 127.0.0.1 only, and never left behind.

Ray has no authentication and runs what it is sent, so a local run must not listen on the network. By
default Ray 2.60 on Linux binds its GCS, raylet and every worker's gRPC port to all interfaces and its
runtime-env agent to the host's routable address: it turns a loopback node address into the routable one
(`ray._private.services.resolve_ip_for_localhost` -> `get_node_ip_address`, gated by
`ray_constants.ENABLE_RAY_CLUSTER`, which Ray reads from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER at import). With
that switch off, Ray takes 127.0.0.1 as the node address and its C++ servers and agents then bind to
127.0.0.1 only (`loopback_only`). `init_ray` checks the node address Ray ended up with and refuses to run
otherwise. The dashboard stays off (`include_dashboard=False`).

A driver killed with kill -9 leaves part of its Ray behind (the dashboard and runtime-env agents outlive
it, re-parented to init). So each local Ray is marked and recorded when it starts: a fresh token in the
environment every Ray process inherits ($MIXFLEET_RAY_TOKEN), and a record (`<state>/ray/`, state =
$MIXFLEET_STATE_DIR or ~/.cache/mixfleet) of the driver and, once Ray is up, of every process it started
(pid and start time each: the agents retitle themselves, which hides their environment). `stop_leftover_rays`
stops, for every recorded Ray whose driver is gone, the processes carrying its token or recorded by it (and
their children): at the next start and from `mixfleet cleanup`. A process counts only if its pid *and* start
time match (a reused pid is never hit), a Ray whose driver still runs is left alone, and nothing else is
touched.

A record is a file, so what it names is checked against the process table before anything is signalled
(`leftover`): a process is a dead driver's Ray only when it is this user's, its command line is Ray's (an
executable or script of the installed `ray` package, or a `ray::` title), it carries the record's token in its
environment (or, retitled with its environment overwritten, is recorded by pid and start time), and no live
process other than init holds it: every live ancestor is such a Ray process too (a live driver, a shell, or
another Ray such as someone's `ray start` has it, and then it is left alone).

Cluster mode (`--address`) is a separate matter (its own keys and addresses) and untouched here.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixfleet.costmodel.paths import cache_root

LOOPBACK = "127.0.0.1"
LOOPBACK_ADDRESSES = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
TOKEN_ENV = "MIXFLEET_RAY_TOKEN"
STOP_GRACE_S = 3.0             # SIGTERM, then SIGKILL what still runs after this


def loopback_only() -> None:
    """Make the Ray started next (in this process and its children) take 127.0.0.1 as its node address."""
    os.environ[_CLUSTER_ENV] = "0"         # children (gcs_server, raylet, workers, agents) read it at import
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False   # this process already imported ray: the same switch, read per call


def new_token() -> str:
    import uuid

    return uuid.uuid4().hex


@contextmanager
def marking(token: str) -> Iterator[None]:
    """`token` in this process's environment while Ray starts: gcs_server and raylet inherit it, and from the
    raylet every agent and worker. Removed afterwards, so nothing else this driver starts later carries it."""
    old = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = token
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = old


def state_dir() -> Path:
    """The folder of the local Ray records (`ray/`) and the app's key (`ui/`): `$MIXFLEET_STATE_DIR` if set, else
    mixfleet's cache folder (costmodel.paths.cache_root)."""
    own = os.environ.get("MIXFLEET_STATE_DIR")
    return Path(own) if own else cache_root()


def records_dir() -> Path:
    return state_dir() / "ray"


@dataclass(frozen=True)
class Stopped:
    """A leftover Ray process stopped by `stop_leftover_rays`."""

    pid: int
    name: str
    driver_pid: int          # the dead driver whose Ray it was


def _ident(p: Any) -> dict[str, Any]:
    return {"pid": p.pid, "create_time": p.create_time(), "name": p.name()}


def _try_ident(p: Any) -> dict[str, Any] | None:
    import psutil

    try:
        return _ident(p)
    except psutil.Error:
        return None


def _alive(entry: dict[str, Any]) -> Any:
    """The psutil.Process of a recorded entry if that very process still runs (pid and start time), else None."""
    import psutil

    try:
        p = psutil.Process(int(entry["pid"]))
        if abs(p.create_time() - float(entry["create_time"])) > 0.01 or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except (psutil.Error, KeyError, TypeError, ValueError):
        return None


def ray_processes() -> list[Any]:
    """This driver's local Ray: every process it started (gcs_server, raylet, agents, workers)."""
    import psutil

    return psutil.Process().children(recursive=True)


def record_local_ray(token: str, *, started: bool = False) -> Path:
    """Write the record of this process's local Ray, marked with `token`: once before it starts (a driver killed
    while Ray starts is covered too) and again once it is up (`started`: with the processes it started)."""
    import psutil

    me = psutil.Process()
    rec: dict[str, Any] = {"driver": _ident(me), "token": token, "started_utc": time.time()}
    if started:
        rec["processes"] = [e for p in ray_processes() if (e := _try_ident(p)) is not None]
    d = records_dir()
    path = d / f"{me.pid}-{token[:12]}.json"
    try:
        d.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(rec, indent=1))
        os.replace(tmp, path)
    except OSError as e:            # a read-only home must not stop the run; only the cleanup loses its record
        import warnings

        warnings.warn(f"cannot record the local Ray in {d} ({e}): if this run is killed, stop its Ray by hand "
                      "(set MIXFLEET_STATE_DIR to a writable folder)", RuntimeWarning, stacklevel=2)
    return path


def _marked(token: str) -> list[Any]:
    """Every process (of this user) whose environment carries `token`."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TOKEN_ENV) == token and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


@functools.lru_cache(maxsize=1)
def _ray_package_dir() -> str | None:
    """The installed `ray` package's folder (found without importing Ray), or None when Ray is not installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("ray")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return os.path.realpath(locations[0]) if locations else None


def is_ray_command(cmdline: list[str]) -> bool:
    """True for a command line of Ray's own: a `ray::` process title (workers, agents), or an executable or a
    script inside the installed `ray` package among the first three arguments (gcs_server, raylet,
    `python -u .../ray/_private/log_monitor.py`, the dashboard, the autoscaler's monitor, a worker at start)."""
    if not cmdline or not cmdline[0]:
        return False
    if cmdline[0].startswith("ray::"):
        return True
    root = _ray_package_dir()
    if root is None:
        return False
    return any(os.path.isabs(a) and os.path.realpath(a).startswith(root + os.sep) for a in cmdline[:3])


def leftover(p: Any, token: str, recorded: set[tuple[int, float]]) -> bool:
    """Whether process `p` is part of the dead driver's Ray that a record (its `token`; the pid and start time of
    the processes it `recorded`) describes. Checked against the process table, never taken from the record: this
    user's, a Ray command line, the token in its environment (or an environment overwritten by a retitle and
    the pid and start time recorded), and not held by a live process: every live ancestor below init passes the
    same test (a live driver, a shell, or another Ray holding it means it is not a leftover)."""
    import psutil

    uid = os.getuid()

    def own(q: Any) -> bool:
        try:
            if q.uids().real != uid or q.status() == psutil.STATUS_ZOMBIE or not is_ray_command(q.cmdline()):
                return False
            env = q.environ()
            if env.get(TOKEN_ENV) == token:
                return True
            return not env and any(q.pid == pid and abs(q.create_time() - ct) <= 0.01 for pid, ct in recorded)
        except psutil.Error:
            return False

    if not own(p):
        return False
    q = p
    for _ in range(64):
        try:
            q = q.parent()
        except psutil.Error:
            return False
        if q is None or q.pid <= 1:
            return True
        if not own(q):
            return False                 # held by something live that is not this Ray: not a leftover
    return False


def _recorded(rec: dict[str, Any]) -> set[tuple[int, float]]:
    out = set()
    for e in rec.get("processes") or []:
        try:
            out.add((int(e["pid"]), float(e["create_time"])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def stop_leftover_rays(*, grace_s: float = STOP_GRACE_S) -> list[Stopped]:
    """Stop the recorded local Rays whose driver is gone; drop their records. Returns what was stopped.
    Only processes that `leftover` finds to be that Ray's own are signalled, whatever a record says."""
    import psutil

    d = records_dir()
    if not d.is_dir():
        return []
    victims: dict[int, tuple[Any, Stopped]] = {}
    done: list[Path] = []
    me = os.getpid()
    records = []
    for path in sorted(d.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            driver, token = rec["driver"], str(rec["token"])
            if not isinstance(driver, dict) or not token:
                raise TypeError("driver")
        except (OSError, ValueError, KeyError, TypeError):
            done.append(path)                       # unreadable record: nothing it names can be trusted
            continue
        records.append((path, rec, driver, token))
    live_tokens = {token for _, _, driver, token in records if _alive(driver) is not None}
    for path, rec, driver, token in records:
        if token in live_tokens:
            continue                                # a live run: its Ray is its own
        recorded = _recorded(rec)
        found = _marked(token) + [p for e in rec.get("processes") or [] if isinstance(e, dict)
                                  and (p := _alive(e)) is not None]
        for p in list(found):
            try:
                found += p.children(recursive=True)        # workers the raylet started after the record
            except psutil.Error:
                pass
        for q in found:
            if q.pid != me and q.pid not in victims and leftover(q, token, recorded):
                try:
                    victims[q.pid] = (q, Stopped(q.pid, q.name(), int(driver.get("pid", -1))))
                except (psutil.Error, TypeError, ValueError):
                    continue
        done.append(path)
    procs = [q for q, _ in victims.values()]
    for q in procs:
        try:
            q.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for q in alive:                                  # the agents ignore SIGTERM
        try:
            q.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    for path in done:
        path.unlink(missing_ok=True)
    return [s for _, s in victims.values()]


def listening_sockets(procs: list[Any]) -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every TCP/UDP socket the processes listen on (UDP: every bound one)."""
    import psutil

    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
            name = p.name()
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN or (c.type == 2 and c.laddr):     # 2 = SOCK_DGRAM
                out.append((p.pid, name, c.laddr.ip, c.laddr.port))
    return sorted(out)
