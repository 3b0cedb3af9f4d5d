"""The repo task's scripted demonstrations, measured: reward, turns, tokens, finish reasons, and seconds per
demonstration episode in the real sandbox on this machine (what `mixfleet pretrain --task repo` spends on its
2000 demonstrations before training).

Why: the base policy imitates these, so their reward (the noisy demonstrator's success) and their length against
the 1024-token context bound what it can learn; their cost says how long a repo pretraining waits for data.
Also checks the generator in the sandbox: for `--check N` seeds of each split the buggy repository fails its
tests and the reference fix passes.

    python benchmarks/repo_demos.py [--episodes 100] [--noise 0.1] [--check 100]

Writes benchmarks/results/repo_demos.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "repo_demos.json"


async def _check(seeds: list[int]) -> list[int]:
    from mixfleet.runner.rollout.demos import repo_edit_command
    from mixfleet.runner.rollout.sandbox import Sandbox
    from mixfleet.runner.rollout.tasks.repo import generate

    bad = []
    for seed in seeds:
        p = generate(seed)
        src = Path(tempfile.mkdtemp(prefix="repo-check-"))
        try:
            for rel, text in p.files.items():
                (src / rel).write_text(text)
            async with await Sandbox.create(src) as sb:
                before = await sb.exec(p.test_command)
                edit = await sb.exec(repo_edit_command(p.buggy_text.rstrip("\n"), p.fix_text.rstrip("\n"),
                                                       python=seed % 2 == 0))
                after = await sb.exec(p.test_command)
            if before.exit_code == 0 or edit.exit_code != 0 or after.exit_code != 0:
                bad.append(seed)
        finally:
            shutil.rmtree(src, ignore_errors=True)
    return bad


def main() -> None:
    from mixfleet.runner.rollout.agent import AgentConfig
    from mixfleet.runner.rollout.demos import DemoConfig, demo_stats, generate_demos
    from mixfleet.runner.rollout.tasks import split_seeds

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--check", type=int, default=100, help="seeds per split for the generator check (0: skip)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    eps = generate_demos(DemoConfig(task="repo", num_episodes=args.episodes, noise=args.noise),
                         agent=AgentConfig(context_length=1024))
    wall = time.perf_counter() - t0
    stats = demo_stats(eps)
    stats["max_tokens"] = float(max(len(e.tokens) for e in eps))
    stats["s_per_episode"] = wall / len(eps)
    out = {"command": f"python benchmarks/repo_demos.py --episodes {args.episodes} --noise {args.noise} "
                      f"--check {args.check}",
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "load_avg_1m_at_start": os.getloadavg()[0]},
           "demos": stats}
    if args.check:
        seeds = split_seeds("train", args.check) + split_seeds("eval", args.check)
        t1 = time.perf_counter()
        bad = asyncio.run(_check(seeds))
        out["generator_check"] = {"seeds": len(seeds), "invalid": bad, "wall_s": time.perf_counter() - t1}
    print(json.dumps(out, indent=2))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
