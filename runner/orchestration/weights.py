"""Weight publishing: each new version exported by the trainer and pushed to the sampler groups the plan's
weight-sync policy picks (drain: the group stops admitting and finishes its requests first; in flight:
loaded between decode steps). A load that fails leaves the replica serving its previous version (event
"weight_push_failed").

With Ray actors (embedded or SGLang replicas) no filesystem is shared: the trainer publishes a version
once into Ray's object store and deletes its export, each node's cache fetches it once, and its replicas
load it from that node-local folder (runner/orchestration/distribution.py); the base checkpoint is
published by the driver. Versions stay published while they are among the newest `KEEP_WEIGHT_VERSIONS`
or a replica is starting from them (pinned). Attached servers (`--attach`) are given the trainer's export
folder itself (they must see it), kept on disk by the same rule.

Each `weight_push` event (per group and version) says in its JSON detail (costmodel/records/ledger.py) the
version's publish seconds, the group's transfer seconds (the slowest of its nodes' one fetch) and load
seconds (its replicas' loads), besides mode / replicas / loaded.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
from mixfleet.costmodel.records.ledger import weight_push_detail
from mixfleet.runner.orchestration.config import WEIGHTS_DIR, RunContext
from mixfleet.runner.orchestration.distribution import KEEP_NODE_VERSIONS, NodeCaches, publish_folder
from mixfleet.runner.sampler.client import SamplerHTTPError, SamplerUnavailable

if TYPE_CHECKING:
    from mixfleet.runner.orchestration.sampler_fleet import Replica, SamplerFleet

KEEP_WEIGHT_VERSIONS = KEEP_NODE_VERSIONS
NODE_CACHE_DIR = "node_cache"


def _same_path(group: str, version: int, path: str) -> str:
    return path


class WeightPublisher:
    """The newest weights (`version`; `path` the trainer-side folder) and their way to the samplers.

    `source_for(group, version, path) -> path` says which folder a group loads a pushed version from: the
    node-local copy (or the export, attached). It is a hook: a test may install one that hands a group a
    broken copy (a real failed load).
    """

    def __init__(self, ctx: RunContext, weight_sync: Any, init_checkpoint: str, *, distributed: bool = True) -> None:
        self.ctx, self.weight_sync = ctx, weight_sync
        self.path = init_checkpoint
        self.version = 0                              # the newest version
        self.distributed = distributed
        self.run_id = f"{ctx.out.name[:24]}-{secrets.token_hex(4)}"
        # a local Ray's one node caches inside the run's folder; a cluster node in its own cache or temp dir
        local_root = None if ctx.config.address else str(ctx.out / NODE_CACHE_DIR)
        self.caches = NodeCaches(self.run_id, local_root) if distributed else None
        self.published: dict[int, dict[str, Any]] = {}   # version -> its object-store references
        self.driver_node: str | None = None
        self._pinned: dict[int, int] = {}             # versions replicas are starting from (kept)
        self.source_for: Callable[[str, int, str], str] = _same_path

    async def begin(self, *, publish_base: bool = True) -> None:
        """Ray is up: note the driver's node, start the node caches and publish the base checkpoint."""
        if not self.distributed:
            return
        import ray

        self.driver_node = ray.get_runtime_context().get_node_id()
        if not self.ctx.config.address:               # a killed earlier local run's copies: ours to remove
            shutil.rmtree(self.ctx.out / NODE_CACHE_DIR, ignore_errors=True)
        self.caches.ensure()
        if publish_base:
            self.published[0] = await asyncio.to_thread(publish_folder, self.path, version=0)

    def pin(self) -> tuple[str, int]:
        """The newest (path, version), kept published / on disk until `unpin(version)` (a replica starts from it)."""
        self._pinned[self.version] = self._pinned.get(self.version, 0) + 1
        return self.path, self.version

    def unpin(self, version: int) -> None:
        self._pinned[version] -= 1

    def starting_weights(self, version: int) -> dict[str, Any] | None:
        """What a replica starting from `version` is given (None: the path itself, attached servers)."""
        return self.published.get(version) if self.distributed else None

    def _keep(self) -> set[int]:
        newest = sorted(set(self.published) | {self.version})[-KEEP_WEIGHT_VERSIONS:]
        return set(newest) | {v for v, n in self._pinned.items() if n > 0}

    async def export(self, trainer: Any, version: int) -> str:
        """The trainer writes version `version` (and, with Ray actors, publishes it and deletes the export);
        versions beyond the newest few go (unless pinned)."""
        out = self.ctx.out / WEIGHTS_DIR
        path = out / f"v{version:06d}"
        if self.distributed:
            pub = await trainer.export_and_publish.remote(str(path), version)
            self.published[version] = pub
        else:
            await trainer.export.remote(str(path), version)
        self.path, self.version = str(path), version
        keep = self._keep()
        if self.distributed:
            for v in [v for v in self.published if v not in keep]:
                del self.published[v]                 # the object store frees it once no replica holds it
            await self.caches.gc(keep)
        else:
            for old in sorted(out.glob("v*")):
                if int(old.name[1:]) not in keep:
                    shutil.rmtree(old, ignore_errors=True)
        return str(path)

    async def source(self, rep: Replica, version: int) -> tuple[str, float]:
        """(folder `rep` loads `version` from, seconds its node's one fetch took)."""
        if not self.distributed or rep.node is None:
            return self.source_for(rep.group, version, self.path), 0.0
        path, transfer_s = await self.caches.path(rep.node, self.published[version])
        return self.source_for(rep.group, version, path), transfer_s

    async def local_copy(self) -> str:
        """The newest version as a folder on the driver's node (the driver's own evaluation reads it)."""
        if not self.distributed:
            return self.path
        path, _ = await self.caches.path(self.driver_node, self.published[self.version])
        return path

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

    async def catch_up(self, rep: Replica) -> None:
        """A replica that started (or attached) on an older version loads the newest."""
        version = self.version
        try:
            path, _ = await self.source(rep, version)
        except Exception as e:  # noqa: BLE001 - its node's fetch failed: it serves its version, said so
            self.ctx.event("weight_push_failed", rep.group, rep.index, version,
                           detail=f"serving version {rep.version}: fetch failed: {type(e).__name__}: {e}"[:300])
            return
        await self.load(rep, path, version)

    async def publish(self, trainer: Any, version: int, fleet: SamplerFleet) -> float:
        """Export `version` and push it to every group the weight-sync policy picks (concurrently); returns
        the seconds it took."""
        ctx = self.ctx
        t0 = ctx.now()
        await self.export(trainer, version)
        publish_s = float(self.published[version]["publish_s"]) if self.distributed else 0.0

        async def push_group(name: str) -> None:
            decision = self.weight_sync.decide(fleet.group_view(name), version, ctx.now())
            if not decision.push:
                return
            reps = [r for r in fleet.replicas[name] if r.up]
            t1 = ctx.now()
            sources = await asyncio.gather(*[self.source(r, version) for r in reps], return_exceptions=True)
            transfer_s = max([s[1] for s in sources if not isinstance(s, BaseException)], default=0.0)
            t2 = ctx.now()
            if decision.drain:
                for r in reps:
                    r.admitting.clear()
                while any(r.running for r in reps):
                    await asyncio.sleep(0.02)

            async def one(r: Replica, src: Any) -> bool:
                if isinstance(src, BaseException):
                    ctx.event("weight_push_failed", r.group, r.index, version,
                              detail=f"serving version {r.version}: fetch failed: {type(src).__name__}: {src}"[:300])
                    return False
                return await self.load(r, src[0], version)

            t3 = ctx.now()
            oks = await asyncio.gather(*[one(r, s) for r, s in zip(reps, sources, strict=True)])
            load_s = ctx.now() - t3
            for r in reps:
                r.admitting.set()
            detail = weight_push_detail("drain" if decision.drain else "in_flight", len(reps), sum(oks),
                                        publish_s=publish_s, transfer_s=transfer_s, load_s=load_s,
                                        fetch_wait_s=t2 - t1, nodes=len({r.node for r in reps}))
            ctx.event("weight_push", name, version=version, duration_s=ctx.now() - t1, detail=detail)

        await asyncio.gather(*[push_group(name) for name in fleet.names])
        return ctx.now() - t0

    async def close(self) -> None:
        self.published.clear()
        if self.caches is not None:
            await self.caches.close()
