"""Weight publishing: each new version exported by the trainer to `OUT/weights/vNNNNNN` and pushed to the
sampler groups the plan's weight-sync policy picks (drain: the group stops admitting and finishes its
requests first; in flight: loaded between decode steps). A load that fails leaves the replica serving its
previous version (event "weight_push_failed"). The newest `KEEP_WEIGHT_VERSIONS` exports are kept, and
any folder a replica is still starting from.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
from mixfleet.costmodel.ledger import weight_push_detail
from mixfleet.runner.orchestration.config import WEIGHTS_DIR, RunContext
from mixfleet.runner.sampler.client import SamplerHTTPError, SamplerUnavailable

if TYPE_CHECKING:
    from mixfleet.runner.orchestration.sampler_fleet import Replica, SamplerFleet

KEEP_WEIGHT_VERSIONS = 3


def _same_path(group: str, version: int, path: str) -> str:
    return path


class WeightPublisher:
    """The newest weights (`path`, `version`) and their way to the samplers.

    `source_for(group, version, path) -> path` says which folder a group loads a pushed version from: the
    export itself. It is a hook: a test may install one that hands a group a broken copy (a real failed load).
    """

    def __init__(self, ctx: RunContext, weight_sync: Any, init_checkpoint: str) -> None:
        self.ctx, self.weight_sync = ctx, weight_sync
        self.path = init_checkpoint
        self.version = 0                              # the version `path` holds
        self._pinned: dict[str, int] = {}             # weight folders replicas are starting from (not deleted)
        self.source_for: Callable[[str, int, str], str] = _same_path

    def pin(self) -> tuple[str, int]:
        """The newest (path, version), kept on disk until `unpin(path)` (a replica starts from it)."""
        self._pinned[self.path] = self._pinned.get(self.path, 0) + 1
        return self.path, self.version

    def unpin(self, path: str) -> None:
        self._pinned[path] -= 1

    async def export(self, trainer: Any, version: int) -> str:
        """The trainer writes version `version`; older exports beyond the newest few go (unless pinned)."""
        out = self.ctx.out / WEIGHTS_DIR
        path = out / f"v{version:06d}"
        await trainer.export.remote(str(path), version)
        for old in sorted(out.glob("v*"))[:-KEEP_WEIGHT_VERSIONS]:
            if not self._pinned.get(str(old)):
                shutil.rmtree(old, ignore_errors=True)
        self.path, self.version = str(path), version
        return str(path)

    async def load(self, rep: Replica, path: str, version: int) -> bool:
        """One replica loads `path` as `version`; False (and an event) when it refuses or cannot be reached."""
        ctx = self.ctx
        t0 = ctx.now()
        try:
            res = await rep.client.update_weights_from_disk(path, weight_version=str(version))
        except (SamplerUnavailable, httpx.HTTPError, SamplerHTTPError) as e:
            res = {"success": False, "message": f"{type(e).__name__}: {e}"}
        ok = bool(res.get("success"))
        if ok:
            rep.version = version
        else:
            ctx.event("weight_push_failed", rep.group, rep.index, version,
                      detail=f"serving version {rep.version}: {str(res.get('message', ''))[:300]}",
                      duration_s=ctx.now() - t0)
        return ok

    async def publish(self, trainer: Any, version: int, fleet: SamplerFleet) -> float:
        """Export `version` and push it to every group the weight-sync policy picks (concurrently); returns
        the seconds it took."""
        ctx = self.ctx
        t0 = ctx.now()
        path = await self.export(trainer, version)

        async def push_group(name: str) -> None:
            decision = self.weight_sync.decide(fleet.group_view(name), version, ctx.now())
            if not decision.push:
                return
            reps = [r for r in fleet.replicas[name] if r.up]
            src = self.source_for(name, version, path)
            t1 = ctx.now()
            if decision.drain:
                for r in reps:
                    r.admitting.clear()
                while any(r.running for r in reps):
                    await asyncio.sleep(0.02)
            oks = await asyncio.gather(*[self.load(r, src, version) for r in reps])
            for r in reps:
                r.admitting.set()
            ctx.event("weight_push", name, version=version, duration_s=ctx.now() - t1,
                      detail=weight_push_detail("drain" if decision.drain else "in_flight", len(reps), sum(oks)))

        await asyncio.gather(*[push_group(name) for name in fleet.names])
        return ctx.now() - t0
