"""Shared helpers of the tests that check mixfleet trusts no file or page about processes and paths (issue 24,
the second probe): someone else's real process, and a plan's TOML text with fields overridden."""

from __future__ import annotations

import subprocess

import psutil
import tomli_w
from mixfleet.policies.plan import load_plan

SECRET = "SECRET-9f3e1c"


def sleeper(env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Someone else's process: a real `sleep 60` in a session (and process group) of its own."""
    return subprocess.Popen(["sleep", "60"], start_new_session=True, env=env)


def running(proc: subprocess.Popen[bytes]) -> bool:
    """Still running (not exited, not a zombie)."""
    if proc.poll() is not None:
        return False
    try:
        return psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def end_all(*procs: subprocess.Popen[bytes]) -> None:
    """Kill and reap what is still running of the processes this test started."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def plan_text(**over: str) -> str:
    return tomli_w.dumps({**load_plan("tiny-cpu").to_dict(), **over})
