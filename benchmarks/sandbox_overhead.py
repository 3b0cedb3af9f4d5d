"""What a bubblewrap sandbox costs on this machine: sandbox start (create + close), per-command overhead against a
plain subprocess (`true`, `python3 -c pass`, `python3 -m unittest` on a one-test file), median and p95, and
tasks per minute through a SandboxPool of N sandboxes (each task: create, 3 commands, diff, close).

    nice -n 10 python benchmarks/sandbox_overhead.py [--reps 20] [--tasks 12] [--pools 1,2,4]
        [--out benchmarks/results/sandbox_overhead.json]

The plain subprocess runs `bash -c CMD` in a copy of the same folder with the sandbox's PATH (same python3).
The machine is shared: the load average before and after is recorded next to the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from mixfleet.runner.rollout.sandbox import Sandbox, SandboxLimits, SandboxPool, check_sandbox
from mixfleet.runner.rollout.sandbox.box import PATH

COMMANDS = {"true": "true", "python3 -c pass": "python3 -c pass", "python3 -m unittest": "python3 -m unittest -q"}
TASK_COMMANDS = ("cat calc.py", "python3 -m unittest -q", "sed -i 's/a - b/a + b/' calc.py && python3 -m unittest -q")


def _repo(root: Path) -> Path:
    src = root / "src"
    src.mkdir()
    (src / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (src / "test_calc.py").write_text("import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
                                      "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n")
    return src


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    p95 = s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]
    return {"n": len(s), "median_ms": round(1e3 * statistics.median(s), 2), "p95_ms": round(1e3 * p95, 2),
            "min_ms": round(1e3 * s[0], 2)}


async def _plain(cmd: str, cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec("/bin/bash", "-c", cmd, cwd=cwd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT,
                                                env={"PATH": PATH, "HOME": str(cwd), "LANG": "C.UTF-8",
                                                     "PYTHONDONTWRITEBYTECODE": "1"})
    await proc.communicate()
    return time.perf_counter() - t0


async def commands(src: Path, reps: int) -> dict[str, Any]:
    plain_dir = src.parent / "plain"
    shutil.copytree(src, plain_dir)
    out: dict[str, Any] = {}
    async with await Sandbox.create(src) as box:
        for name, cmd in COMMANDS.items():
            plain, boxed = [], []
            for _ in range(reps):             # interleaved, so load changes hit both alike
                plain.append(await _plain(cmd, plain_dir))
                r = await box.exec(cmd)
                assert r.exit_code != 124, r.output
                boxed.append(r.elapsed_s)
            ps, bs = _stats(plain), _stats(boxed)
            out[name] = {"plain": ps, "sandbox": bs,
                         "overhead_median_ms": round(bs["median_ms"] - ps["median_ms"], 2)}
            print(f"  {name:22s} plain {ps['median_ms']:8.1f} ms (p95 {ps['p95_ms']:8.1f})   sandbox "
                  f"{bs['median_ms']:8.1f} ms (p95 {bs['p95_ms']:8.1f})   "
                  f"overhead {out[name]['overhead_median_ms']:+.1f} ms")
    return out


async def starts(src: Path, reps: int) -> dict[str, Any]:
    create, close = [], []
    for _ in range(reps):
        box = await Sandbox.create(src)
        create.append(box.start_s)
        t0 = time.perf_counter()
        await box.close()
        close.append(time.perf_counter() - t0)
    out = {"create": _stats(create), "close": _stats(close)}
    print(f"  sandbox create {out['create']['median_ms']:.1f} ms (p95 {out['create']['p95_ms']:.1f}), close "
          f"{out['close']['median_ms']:.1f} ms (p95 {out['close']['p95_ms']:.1f})")
    return out


async def pool_rate(src: Path, n: int, tasks: int) -> dict[str, Any]:
    pool = SandboxPool(n, limits=SandboxLimits(timeout_s=60))
    durations: list[float] = []

    async def task() -> None:
        async with pool.sandbox(src) as box:
            t0 = time.perf_counter() - box.start_s        # from the start of create (after any pool wait)
            for cmd in TASK_COMMANDS:
                await box.exec(cmd)
            assert "+    return a + b" in await box.diff()
        durations.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(task() for _ in range(tasks)))
    wall = time.perf_counter() - t0
    s = pool.stats()
    out = {"sandboxes": n, "tasks": tasks, "wall_s": round(wall, 3), "tasks_per_min": round(60 * tasks / wall, 1),
           "task_s": _stats(durations), "pool_waits": s["waits"], "pool_wait_s_total": round(s["wait_s_total"], 3),
           "peak_live": s["peak_live"]}
    print(f"  pool of {n}: {tasks} tasks in {wall:.2f} s = {out['tasks_per_min']:.1f} tasks/min "
          f"(task median {out['task_s']['median_ms']:.0f} ms, {s['waits']} waits)")
    return out


def _bwrap_version() -> str:
    return subprocess.run(["/usr/bin/bwrap", "--version"], capture_output=True, text=True).stdout.strip()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    check_sandbox()
    with tempfile.TemporaryDirectory() as tmp:
        src = _repo(Path(tmp))
        load0 = os.getloadavg()
        print("per command (interleaved reps):")
        cmds = await commands(src, args.reps)
        print("sandbox start:")
        st = await starts(src, args.reps)
        print("tasks through a pool (create + 3 commands + diff + close):")
        pools = [await pool_rate(src, n, args.tasks) for n in args.pools]
        load1 = os.getloadavg()
    return {"benchmark": "sandbox_overhead", "command": "nice -n 10 python benchmarks/sandbox_overhead.py",
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version(),
                        "bwrap": _bwrap_version(), "as_root": os.geteuid() == 0,
                        "loadavg_before": [round(x, 2) for x in load0], "loadavg_after": [round(x, 2) for x in load1]},
            "reps": args.reps, "commands": cmds, "start": st, "pools": pools,
            "task_commands": list(TASK_COMMANDS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tasks", type=int, default=12)
    ap.add_argument("--pools", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--out", type=Path,
                    default=Path(__file__).resolve().parent / "results" / "sandbox_overhead.json")
    args = ap.parse_args()
    result = asyncio.run(run(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
