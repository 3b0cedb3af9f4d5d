"""A bounded pool of live sandboxes: requests wait while `max_live` are open, and the waits are recorded."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from mixfleet.runner.rollout.sandbox.box import Sandbox, SandboxLimits

# Which pool an episode's sandboxes come from: "train" (a run's training episodes) unless a caller says otherwise
# for the episodes it starts (their asyncio tasks copy the context): an evaluation's episodes take "eval", a pool of
# the same size of their own, so that they never wait behind training episodes for a sandbox nor hold one that a
# training episode waits for (a run's held-out evaluation stalled its training: tool seconds per update 1373 s).
POOL_ROLE: contextvars.ContextVar[str] = contextvars.ContextVar("mixfleet_sandbox_pool_role", default="train")


@contextlib.contextmanager
def pool_role(role: str) -> Iterator[None]:
    """The episodes started inside (as asyncio tasks) take their sandboxes from the pool of `role`."""
    token = POOL_ROLE.set(role)
    try:
        yield
    finally:
        POOL_ROLE.reset(token)


class SandboxPool:
    """At most `max_live` sandboxes open at once (one event loop); `sandbox(source)` waits for a free slot."""

    def __init__(self, max_live: int, *, limits: SandboxLimits | None = None) -> None:
        if not isinstance(max_live, int) or isinstance(max_live, bool) or not 1 <= max_live <= 1024:
            raise ValueError(f"SandboxPool max_live={max_live!r}: must be an integer in [1, 1024]")
        self.max_live = max_live
        self.limits = limits or SandboxLimits()
        self._slots: asyncio.Semaphore | None = None
        self._live = 0
        self._stats: dict[str, Any] = {"starts": 0, "wait_s_total": 0.0, "waits": 0, "start_s_total": 0.0,
                                       "exec_count": 0, "exec_s_total": 0.0, "peak_live": 0}

    @contextlib.asynccontextmanager
    async def sandbox(self, source: Path) -> AsyncIterator[Sandbox]:
        """A fresh sandbox on a copy of `source`, closed on exit; waits (recorded) while max_live are open."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_live)
        t0 = time.perf_counter()
        waited = self._slots.locked()
        await self._slots.acquire()
        try:
            if waited:
                self._stats["waits"] += 1
                self._stats["wait_s_total"] += time.perf_counter() - t0
            box = await Sandbox.create(source, limits=self.limits)
            self._live += 1
            self._stats["peak_live"] = max(self._stats["peak_live"], self._live)
            self._stats["starts"] += 1
            self._stats["start_s_total"] += box.start_s
            try:
                yield box
            finally:
                self._live -= 1
                self._stats["exec_count"] += box.exec_count
                self._stats["exec_s_total"] += box.exec_s_total
                await box.close()
        finally:
            self._slots.release()

    def stats(self) -> dict[str, Any]:
        """Starts, live now, max_live, waits and their seconds, start seconds, commands run and their seconds
        (commands counted when their sandbox closes), and the most sandboxes ever open at once (peak_live)."""
        return {**self._stats, "live": self._live, "max_live": self.max_live}
