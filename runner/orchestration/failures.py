"""A failed run's message in one line: the trainer's own error out of Ray's wrapped traceback (`trainer_error`),
an actor's death (`actor_died`), the cause of a failed write (`write_failure`: a full disk named so), and what
`--resume` continues from (`resume_hint`). Used by the update loop (runner/orchestration/orchestrator.py).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
from pathlib import Path

_ERROR_LINE = re.compile(r"^\s*(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)):\s?(.*)$")


def trainer_error(exc: BaseException) -> str:
    """The trainer's own error in one line ("ValueError: ..."), from the Ray error that wraps it with the
    actor's traceback (a failed __init__ arrives as an ActorDiedError of ~90 lines)."""
    lines = str(exc).splitlines()
    for line in reversed(lines):
        m = _ERROR_LINE.match(line)
        if m and not m.group(1).startswith(("RayTaskError", "ActorDiedError", "RayActorError")):
            return f"{m.group(1)}: {m.group(2)}".strip()
    return next((ln.strip() for ln in lines if ln.strip()), type(exc).__name__)


def resume_hint(saved: int) -> str:
    """What a failed run's message says about continuing it: the checkpoint it continues from."""
    start = f"update {saved}'s checkpoint" if saved > 0 else "the base policy (no checkpoint was completed)"
    return (f"--resume continues from {start}, rolling back the run log's rows after it, once the cause is gone")


_CLASS_NAME = re.compile(r"class_name:\s*(\w+)")
_WHY_DEAD = re.compile(r"(The actor (?:is dead|died)[^.]*\.)")


def actor_died(exc: BaseException) -> str | None:
    """One line for a Ray actor's death (the trainer's, a sampler's: ActorDiedError and kin, ~150 lines of
    Ray's text); None for any other error."""
    if not _is_ray_error(exc, "RayActorError"):
        return None
    text = str(exc)
    m = _CLASS_NAME.search(text)
    cls = m.group(1) if m else "an actor"
    who = {"TrainerWorker": "the trainer", "SamplerWorker": "a sampler replica"}.get(cls, "a Ray actor")
    why = _WHY_DEAD.search(text)
    return f"{who} ({cls}) died ({type(exc).__name__}: {why.group(1) if why else 'its process ended'})"


def write_failure(exc: BaseException, folder: Path) -> str:
    """The cause of a failed write into `folder` in a few words: "no space left on device" when the error says
    so or the filesystem is full (torch's writer reports only "file write failed"), else the writer's own error."""
    import errno

    text = str(exc)
    full = (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left on device" in text
    if not full:
        here = next((p for p in (folder, *folder.parents) if p.exists()), None)
        with contextlib.suppress(OSError):
            full = here is not None and shutil.disk_usage(here).free < 1 << 20
    if full:
        return "no space left on device"
    if _is_ray_error(exc):
        return trainer_error(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _is_ray_error(exc: BaseException, kind: str = "RayError") -> bool:
    ray_exc = sys.modules.get("ray.exceptions")         # loaded once a run has imported Ray
    return ray_exc is not None and isinstance(exc, getattr(ray_exc, kind))
