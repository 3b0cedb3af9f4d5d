"""Running the planner's twin checks fast: on this machine's cores, and never twice for the same inputs.

A twin check (`twin_check`, which the planner's search is handed: `planner.search.plan_mix(check=twin_check)`)
is a pure function of its job (the plan as a dict, the updates, the seed,
the calibration) and of the code and data that simulate it: the same job gives the same figures, bit for bit,
in any process. So

- `local_map` runs the jobs as processes on this machine's cores (the default `CheckMap`; one job or one core:
  in this process, as `planner.search.sequential_map`), with the results in the jobs' order;
- `cached_map(check_map)` keeps each check's result on disk, keyed on the digest of its job and of the code and
  data it runs (`code_digest`: every source and data file of costmodel/, policies/, planner/, twin/ and data/, the
  compiled core included), and of the contents of any spec file the plan names by path. `mixfleet plan` run
  twice, or the app's Plan page asked the same question again, reads the checks instead of re-simulating them.

The cache lives under `$MIXFLEET_CACHE_DIR` if set, else mixfleet's cache folder (`costmodel.paths.cache_root`:
`$MIXFLEET_CACHE`, default `$XDG_CACHE_HOME/mixfleet` or `~/.cache/mixfleet`), in
`twin-checks/`, one small JSON file per check; `MIXFLEET_NO_CACHE=1` turns it off (reads and writes). A file
that cannot be read or written is ignored (the check is then run), so a read-only home costs only the speed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from mixfleet.costmodel.paths import cache_root
from mixfleet.policies.plan import plan_from_dict

Job = tuple[Any, ...]
CheckMap = Callable[[Callable[..., dict[str, Any]], list[Job]], tuple[list[dict[str, Any]], dict[str, Any]]]

_ROOT = Path(__file__).resolve().parent.parent   # the package's root (costmodel/, policies/, planner/, twin/, data/)
_CODE_DIRS = ("costmodel", "policies", "planner", "twin", "data")
_CODE_SUFFIXES = (".py", ".so", ".pyd", ".toml", ".json", ".csv", ".yaml", ".txt")


def twin_check(plan: dict[str, Any], updates: int, seed: int, calibration: Any = None) -> dict[str, Any]:
    """One twin check, a job any worker can run: the plan (as `Plan.to_dict`) simulated from a warm start for
    `updates` updates on `seed`; its steady-state figures (costmodel's analysis: means and 95% half-widths) and
    the preemption losses the twin saw (turns cut by a lost replica, trajectories restarted)."""
    from mixfleet.twin.sim import simulate

    r = simulate(plan_from_dict(plan), updates=updates, seed=seed, calibration=calibration, warm_start=True)
    s = r.summary
    return {"time_per_update_s": s.steady_time_per_update_s, "time_per_update_ci_s": s.steady_time_per_update_ci_s,
            "cost_per_update_usd": s.steady_cost_per_update_usd,
            "cost_per_update_ci_usd": s.steady_cost_per_update_ci_usd,
            "cost_sampler_per_update_usd": s.steady_cost_sampler_per_update_usd,
            "cost_sampler_per_update_ci_usd": s.steady_cost_sampler_per_update_ci_usd,
            "cost_sandbox_per_update_usd": s.steady_cost_sandbox_per_update_usd,
            "cost_sandbox_per_update_ci_usd": s.steady_cost_sandbox_per_update_ci_usd,
            # 0 for a plan without sandboxes (the summary's NaN would make equal checks compare unequal)
            "sandbox_wait_share": s.sandbox_wait_share if math.isfinite(s.sandbox_wait_share) else 0.0,
            "extreme_share": s.extreme_share, "staleness": s.steady_staleness_mean,
            "staleness_ci": s.steady_staleness_ci,
            "tokens_per_s": s.steady_tokens_per_s, "fill_s": s.first_update_s, "updates": updates,
            "warmup_updates": s.warmup_updates, "steady_updates": s.steady_updates, "seed": seed,
            "turns_lost": r.turns_lost, "sessions_restarted": r.sessions_restarted,
            "group_share_of_samples": dict(s.group_share_of_samples)}


def cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


def local_map(fn: Callable[..., dict[str, Any]], jobs: list[Job], *, workers: int = 0
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`fn(*job)` for every job, as processes on this machine's cores; results in the jobs' order, the same as one
    after another in this process. One worker: in this process.

    workers: 0 = up to two per core (one core: in this process), at most one per job. Up to twice the cores, every
    job runs at once and the kernel shares the cores: jobs of about equal length then end together, where one
    worker per core leaves cores idle for the last round (3 checks on 2 cores: 1.5 checks' time instead of 2)."""
    c = cores()
    n = min(workers or (2 * c if c > 1 else 1), len(jobs))
    if n <= 1:
        return [fn(*job) for job in jobs], {"mode": "sequential", "workers": 1, "nodes": 1}
    with ProcessPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(_call, [(fn, job) for job in jobs]))
    return results, {"mode": "processes", "workers": n, "nodes": 1}


def _call(fn_job: tuple[Callable[..., dict[str, Any]], Job]) -> dict[str, Any]:
    fn, job = fn_job
    return fn(*job)


def cache_dir() -> Path | None:
    """Where the checks are kept, or None when `MIXFLEET_NO_CACHE` is set."""
    if os.environ.get("MIXFLEET_NO_CACHE", "") not in ("", "0"):
        return None
    own = os.environ.get("MIXFLEET_CACHE_DIR")        # this part alone (the others stay in cache_root)
    return Path(own) / "twin-checks" if own else cache_root("twin-checks")


@functools.cache
def code_digest() -> str:
    """sha256 over every source and data file the twin checks run on (paths and contents)."""
    h = hashlib.sha256()
    for d in _CODE_DIRS:
        for p in sorted((_ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in _CODE_SUFFIXES and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(_ROOT)).encode())
                h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _with_files(x: Any) -> Any:
    """The job with each string that names an existing file paired with the file's digest (a plan may name its
    model or workload spec by path, and the app rewrites such files in place)."""
    if isinstance(x, dict):
        return {str(k): _with_files(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_with_files(v) for v in x]
    if isinstance(x, str) and len(x) < 4096 and ("/" in x or x.endswith((".toml", ".json"))):
        try:
            p = Path(x)
            if p.is_file():
                return [x, hashlib.sha256(p.read_bytes()).hexdigest()]
        except OSError:
            pass
    if hasattr(x, "to_dict"):
        return _with_files(x.to_dict())
    return x


def job_digest(fn: Callable[..., Any], job: Job) -> str:
    """The cache key of one check: the function, the job (with named files' contents) and `code_digest`."""
    payload = json.dumps([f"{fn.__module__}.{fn.__qualname__}", _with_files(list(job)), code_digest()],
                         sort_keys=True, default=repr)
    return hashlib.sha256(payload.encode()).hexdigest()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        with path.open() as f:
            got = json.load(f)
        return got if isinstance(got, dict) else None
    except (OSError, ValueError):
        return None


def _write(path: Path, result: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(result, f)
        os.replace(tmp, path)   # a reader sees the whole file or none
    except (OSError, TypeError, ValueError):
        pass


def cached_map(check_map: CheckMap) -> CheckMap:
    """`check_map` with each result kept on disk under its `job_digest`: jobs already checked are read back (JSON
    keeps every float bit for bit), the rest are handed to `check_map` at once. The info says how many were read
    (`cached`)."""
    def run(fn: Callable[..., dict[str, Any]], jobs: list[Job]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        folder = cache_dir()
        if folder is None:
            results, info = check_map(fn, jobs)
            return results, {**info, "cached": 0}
        paths = [folder / f"{job_digest(fn, job)}.json" for job in jobs]
        got: list[dict[str, Any] | None] = [_read(p) for p in paths]
        todo = [i for i, r in enumerate(got) if r is None]
        info: dict[str, Any] = {"mode": "cache", "workers": 0, "nodes": 1}
        if todo:
            fresh, info = check_map(fn, [jobs[i] for i in todo])
            for i, r in zip(todo, fresh, strict=True):
                got[i] = r
                _write(paths[i], r)
        return [r for r in got if r is not None], {**info, "cached": len(jobs) - len(todo)}
    return run


default_map: CheckMap = cached_map(local_map)
