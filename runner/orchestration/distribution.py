"""Weights that travel without a shared filesystem: Ray's object store, one node-local cache per node.

A version is *published* once: the trainer exports it (HF layout folder), puts each file into Ray's
object store (`publish_folder`: one object per file, so a sharded checkpoint travels shard by shard) and
deletes its export; the driver keeps the references. On every node that serves samplers, one
`NodeWeightCache` actor (placed on that node, named after it) *fetches* a version once into that node's
own cache folder (`$MIXFLEET_NODE_CACHE` as the node was started, else `OUT/node_cache` for a local Ray
or the node's temp dir on a cluster; then `<run>/<node>/vNNNNNN`), and every replica on the node loads it
from there through the usual `/update_weights_from_disk` (real SGLang unchanged). A replica starting on a
node asks its node's cache for its pinned version before its engine loads (`local_path`). Old versions are
deleted per node (`gc`); each cache removes its run's folder when the run ends.

Why the object store and not the trainer node serving files: Ray already moves objects node to node
(pulled by the node that needs them, chunked, spilled to disk under memory pressure, freed when the
driver drops the references), inside the cluster's own network and its own access rules: no extra port to
open or key to hand out, and a node that joins later finds the version where every node does. The cost: a
version sits in the object store while referenced (the newest few and the pinned ones), so the object
store must hold a few checkpoints (`ray start --object-store-memory`).

`NodeCaches` is the driver's side: one cache actor per live node, a fetch per (node, version) shared by
every group and replica there, the seconds each took.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

CACHE_ENV = "MIXFLEET_NODE_CACHE"       # a node's cache root, read by the cache actor in the node's environment
CACHE_PREFIX = "mixfleet-weights"       # named actor: f"{CACHE_PREFIX}-{run}-{node_id}"
KEEP_NODE_VERSIONS = 3                  # versions kept per node (besides those a starting replica needs)


def version_dir(version: int) -> str:
    return f"v{int(version):06d}"


def publish_folder(directory: str | Path, *, version: int) -> dict[str, Any]:
    """Put every file of `directory` into Ray's object store (called where the folder is: the trainer, or
    the driver for the base checkpoint). Returns the published version: {"version", "files": {relative
    path: ObjectRef}, "bytes", "publish_s"}."""
    import ray

    t0 = time.perf_counter()
    root = Path(directory)
    files: dict[str, Any] = {}
    total = 0
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            total += len(data)
            files[p.relative_to(root).as_posix()] = ray.put(data)
    if not files:
        raise FileNotFoundError(f"publish: no files in {root}")
    return {"version": int(version), "files": files, "bytes": total, "publish_s": time.perf_counter() - t0}


def cache_name(run: str, node_id: str) -> str:
    return f"{CACHE_PREFIX}-{run}-{node_id}"


class NodeWeightCache:
    """One node's weight cache (a Ray actor pinned to the node; threaded, so fetches run side by side)."""

    def __init__(self, run: str, default_root: str | None = None) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        root = Path(os.environ.get(CACHE_ENV) or default_root or Path(tempfile.gettempdir()) / CACHE_PREFIX)
        self.dir = root / run / self.node_id[:12]
        self.dir.mkdir(parents=True, exist_ok=True)
        self._locks: dict[int, threading.Lock] = {}
        self._guard = threading.Lock()
        self.fetches = 0

    def where(self) -> dict[str, Any]:
        import ray

        return {"node_id": self.node_id, "dir": str(self.dir), "node_ip": ray.util.get_node_ip_address()}

    def fetch(self, published: Mapping[str, Any]) -> dict[str, Any]:
        """The version's node-local folder, fetched from the object store unless already here. Returns
        {"path", "transfer_s" (0 when cached), "bytes", "fetched"}."""
        import ray

        version = int(published["version"])
        with self._guard:
            lock = self._locks.setdefault(version, threading.Lock())
        with lock:
            final = self.dir / version_dir(version)
            if final.is_dir():
                return {"path": str(final), "transfer_s": 0.0, "bytes": 0, "fetched": False}
            t0 = time.perf_counter()
            tmp = self.dir / f".{version_dir(version)}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            names = list(published["files"])
            total = 0
            for name, data in zip(names, ray.get([published["files"][n] for n in names]), strict=True):
                target = tmp / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                total += len(data)
            os.replace(tmp, final)
            self.fetches += 1
            return {"path": str(final), "transfer_s": time.perf_counter() - t0, "bytes": total, "fetched": True}

    def gc(self, keep: Iterable[int]) -> list[int]:
        """Delete the versions not in `keep`; returns those deleted."""
        keep = {int(v) for v in keep}
        gone = []
        for p in self.dir.glob("v*"):
            v = int(p.name[1:])
            if v not in keep:
                with self._guard:
                    lock = self._locks.setdefault(v, threading.Lock())
                with lock:
                    shutil.rmtree(p, ignore_errors=True)
                gone.append(v)
        return sorted(gone)

    def versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.dir.glob("v*") if p.is_dir())

    def close(self) -> None:
        """The run ended: remove its folder on this node."""
        import contextlib

        shutil.rmtree(self.dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.dir.parent.rmdir()                  # the run's folder, once no node of this machine uses it


def local_path(published: Mapping[str, Any], run: str) -> tuple[str, float]:
    """(node-local folder, transfer seconds) of a published version, from inside a Ray worker (a sampler
    replica starting): asks this node's cache actor, which fetches it once for the node."""
    import ray

    cache = ray.get_actor(cache_name(run, ray.get_runtime_context().get_node_id()))
    res = ray.get(cache.fetch.remote(published))
    return res["path"], float(res["transfer_s"])


class NodeCaches:
    """The driver's view: a cache actor per live node, one fetch per (node, version), gc, close."""

    def __init__(self, run: str, default_root: str | None = None) -> None:
        self.run, self.default_root = run, default_root
        self.actors: dict[str, Any] = {}
        self._fetches: dict[tuple[str, int], asyncio.Task] = {}
        self.transfer_s: dict[tuple[str, int], float] = {}

    def ensure(self) -> list[str]:
        """A cache actor on every live node that has none yet (nodes join a cluster); returns the live nodes."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        live = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        cls = ray.remote(num_cpus=0, max_concurrency=16, max_restarts=0)(NodeWeightCache)
        for node in live:
            if node not in self.actors:
                strategy = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
                self.actors[node] = cls.options(name=cache_name(self.run, node),
                                                scheduling_strategy=strategy).remote(self.run, self.default_root)
        for node in [n for n in self.actors if n not in live]:
            self.forget(node)
        return live

    def forget(self, node: str) -> None:
        """A node is gone: its cache (and what it fetched) with it."""
        self.actors.pop(node, None)
        for key in [k for k in self._fetches if k[0] == node]:
            self._fetches.pop(key)

    async def path(self, node: str, published: Mapping[str, Any]) -> tuple[str, float]:
        """(node-local folder of the version on `node`, seconds its one fetch took): the first caller
        starts the fetch, every other replica and group on that node waits for the same one."""
        key = (node, int(published["version"]))
        task = self._fetches.get(key)
        if task is None:
            if node not in self.actors:
                self.ensure()
            actor = self.actors[node]

            async def fetch() -> dict[str, Any]:
                return await actor.fetch.remote(dict(published))

            task = self._fetches[key] = asyncio.get_running_loop().create_task(fetch())
        try:
            res = await asyncio.shield(task)
        except Exception:
            self._fetches.pop(key, None)            # a failed fetch is tried again by the next caller
            raise
        if res["fetched"]:
            self.transfer_s[key] = float(res["transfer_s"])
        return res["path"], self.transfer_s.get(key, 0.0)

    def note_fetched(self, node: str, version: int, transfer_s: float) -> None:
        """A replica fetched `version` on `node` itself while starting (`local_path`)."""
        self.transfer_s.setdefault((node, int(version)), float(transfer_s))

    async def gc(self, keep: Iterable[int]) -> None:
        import contextlib

        keep = sorted({int(v) for v in keep})
        for key in [k for k in self._fetches if k[1] not in keep]:
            self._fetches.pop(key)
        for actor in list(self.actors.values()):
            with contextlib.suppress(Exception):
                await actor.gc.remote(keep)

    async def close(self) -> None:
        import contextlib

        import ray

        for actor in self.actors.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(actor.close.remote(), 10)
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors.clear()
