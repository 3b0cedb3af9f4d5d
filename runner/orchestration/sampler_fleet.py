"""Fleet management: the sampler replicas of a run, started (Ray actors, or attached servers), watched and
scaled to the plan's autoscaler.

Every monitor tick (`MONITOR_INTERVAL_S`) a replica that looks idle is probed (`/health`): refused, or no
answer `MAX_FAILED_PROBES` times in a row, is a loss (event "crash"); a lost replica is dropped from the
list and the autoscaler's target brings a replacement ("restart", then "cold_start", "ready"). The fleet
also keeps each group's replica-seconds up and billed for the run log (`totals`).

A group none of whose replicas can start (`MAX_START_FAILURES` failed starts in a row, none up or starting:
a broken image, a checkpoint its engine refuses) fails the run (`RunFailed`, naming the group and the last
error) unless the run allows it (`RunConfig.allow_group_loss`): then the group is given up (event
"group_lost", no more restarts) and reported in the run's summary (`lost_groups`).

Attached servers (`--attach GROUP=URL`) follow the same rule: a start is the attach checks, and a URL that
fails them is a failed start ("crash", "start failed: ..."), never "ready". The checks (`_attach`): /health
answers 200 (refused: at once; 503 or no answer: for up to `ATTACH_WAIT_S`), /get_model_info describes a
generation model of the run's own model type and architectures (the init checkpoint's config.json), and the
server then loads the run's weights (`/update_weights_from_disk` of the version the run is at) and reports that
version: a server still holding another run's weights (or its own start-up ones) would otherwise be sampled as
if it served this run's (on main: staleness -1, a KL 100x higher). Its "placed" event says what it held.

On a cluster: every replica is placed (Ray) on a node carrying its group's accelerator, and says where
(event "placed": node, bound address, the node-local folder it started from); lost nodes, and how many
replicas still fit, are placement.py's (`ClusterWatch`). Every replica requires the run's API key
(`api_key`, fresh per run, never logged); attached servers get `$MIXFLEET_API_KEY` if set.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import secrets
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from mixfleet.costmodel.records.ledger import GroupTotals
from mixfleet.policies.views import FleetView, GroupView, ReplicaView
from mixfleet.runner.orchestration.config import RunContext, RunFailed
from mixfleet.runner.orchestration.fleet import FleetSpec, GroupSpec
from mixfleet.runner.orchestration.placement import ClusterWatch
from mixfleet.runner.orchestration.weights import WeightPublisher
from mixfleet.runner.sampler.client import ClientConfig, SamplerClient
from mixfleet.runner.sampler.replica import ReplicaLaunch

MONITOR_INTERVAL_S = 1.0           # the fleet monitor's tick; the autoscaler is asked every min(its interval, 5 s)
PROBE_TIMEOUT_S = 10.0             # a /health probe; no answer in time is "undecided", refused is "dead"
MAX_FAILED_PROBES = 5              # undecided probes in a row of an idle replica that count as a loss
MAX_START_FAILURES = 3             # failed starts in a row of a group with no replica up: it cannot start
ATTACH_WAIT_S = 30.0               # how long an attached server that answers but is not healthy (503) is waited for
ATTACH_POLL_S = 0.5


@dataclass
class Replica:
    group: str
    index: int
    url: str
    client: SamplerClient
    actor: Any = None                          # Ray actor handle (None when attached)
    node: str | None = None                    # Ray node id (None when attached)
    up: bool = True
    version: int = 0
    running: int = 0                           # requests in flight from this orchestrator
    outstanding_tokens: float = 0.0
    busy_s: float = 0.0
    _busy_since: float | None = None
    started_s: float = 0.0
    failed_probes: int = 0                     # consecutive unanswered health probes
    admitting: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.admitting.set()

    def begin(self, now: float, tokens: float) -> None:
        if self.running == 0:
            self._busy_since = now
        self.running += 1
        self.outstanding_tokens += tokens

    def end(self, now: float, tokens: float) -> None:
        self.running -= 1
        self.outstanding_tokens = max(0.0, self.outstanding_tokens - tokens)
        if self.running == 0 and self._busy_since is not None:
            self.busy_s += now - self._busy_since
            self._busy_since = None

    def busy_until(self, now: float) -> float:
        return self.busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)


class ReplicaSeconds:
    """One group's replica-seconds up and billed (up or starting), integrated over the run clock."""

    def __init__(self, now: float) -> None:
        self.t, self.up, self.billed, self.up_s, self.billed_s = now, 0, 0, 0.0, 0.0

    def set(self, now: float, up: int, billed: int) -> None:
        self.advance(now)
        self.up, self.billed = up, billed

    def advance(self, now: float) -> None:
        dt = max(now - self.t, 0.0)
        self.up_s += self.up * dt
        self.billed_s += self.billed * dt
        self.t = now


def _same_launch(launch: ReplicaLaunch) -> ReplicaLaunch:
    return launch


class SamplerFleet:
    """The replicas of every group (`replicas[group]`, up or not yet noticed down) and their monitor.

    `start_launch(launch) -> launch` is what a replica's actor is started with (its `ReplicaLaunch`); a hook,
    like `WeightPublisher.source_for`: a test may hand a group a broken checkpoint (a real failed start).
    """

    def __init__(self, ctx: RunContext, spec: FleetSpec, *, router: Any, autoscaler: Any, weights: WeightPublisher,
                 top_p_replay: bool, routed_experts: bool = False) -> None:
        self.ctx, self.spec, self.router, self.autoscaler, self.weights = ctx, spec, router, autoscaler, weights
        self.top_p_replay, self.routed_experts = top_p_replay, routed_experts
        self.groups: dict[str, GroupSpec] = {g.name: g for g in spec.groups}
        self.names = tuple(self.groups)
        self.replicas: dict[str, list[Replica]] = {n: [] for n in self.names}
        self._next_index = dict.fromkeys(self.names, 0)
        self._starting = dict.fromkeys(self.names, 0)
        self._start_failures = dict.fromkeys(self.names, 0)  # failed starts in a row
        self.lost_groups: dict[str, str] = {}                 # given up (allow_group_loss): group -> last error
        self.start_launch: Callable[[ReplicaLaunch], ReplicaLaunch] = _same_launch
        self._replica_s = {n: ReplicaSeconds(ctx.now()) for n in self.names}
        self._busy_gone_s = dict.fromkeys(self.names, 0.0)   # busy seconds of replicas no longer listed
        self._last_scale_check = -math.inf
        self._probe_http: httpx.AsyncClient | None = None
        # the run's sampler key: fresh per run (actors), or the attached servers' own
        self.api_key = (os.environ.get("MIXFLEET_API_KEY") or None) if spec.mode == "attach" \
            else secrets.token_urlsafe(32)
        self.cluster = ClusterWatch(self)
        self._run_model: dict[str, Any] | None = None          # model_type / architectures of the run's checkpoint

    def restart_clock(self) -> None:
        """A resumed run: replica-seconds count from now (the run clock was set from the checkpoint)."""
        self._replica_s = {n: ReplicaSeconds(self.ctx.now()) for n in self.names}

    def start_planned(self, reserved: dict[str, float] | None = None) -> list[Any]:
        """Coroutines (one per group) that start every group's planned replicas (with Ray actors: as many as
        the cluster holds, less `reserved`, the trainer's; see placement.py). A group none of whose first
        replicas started is tried again at once, until one starts or it cannot start (`_start_failed`), so
        training never begins with a planned group silently missing."""
        if self.spec.mode == "attach":
            fit = {g.name: g.replicas for g in self.spec.groups}
        else:
            fit = self.cluster.fit_planned(reserved or {})
        return [self._start_group(g, fit[g.name]) for g in self.spec.groups]

    async def _start_group(self, g: GroupSpec, n: int) -> None:
        started = await asyncio.gather(*[self.start(g, cold=False) for _ in range(n)])
        while n and not any(started) and g.name not in self.lost_groups and self.ctx.fatal is None:
            self.ctx.event("restart", g.name, self._next_index[g.name], self.ctx.version)
            started = [await self.start(g, cold=True)]

    async def start(self, g: GroupSpec, *, cold: bool) -> Replica | None:
        """Start (or attach) one replica of group `g`; logs cold_start / ready."""
        from mixfleet.runner.orchestration.actors import remote_sampler

        ctx, cfg = self.ctx, self.ctx.config
        index = self._next_index[g.name]
        self._next_index[g.name] += 1
        self._starting[g.name] += 1
        self._recount(g.name)
        t0 = ctx.now()
        actor, info, client = None, {}, None
        path, version = self.weights.pin()
        try:
            if self.spec.mode == "attach":
                url = g.urls[index % len(g.urls)]
                client = self._client(url)
                try:
                    info = await self._attach(client, path, version)
                except BaseException:
                    await client.aclose()
                    raise
            else:
                if self.weights.caches is not None:
                    self.weights.caches.ensure()         # a cache on every live node, before Ray places it
                cls = remote_sampler(accelerator=g.accelerator, amount=g.tp)
                launch = g.launch(index=index, model_path=path,
                                  threads=ctx.settings.threads_per_replica,
                                  seed=cfg.seed * 1009 + zlib.crc32(f"{g.name}/{index}".encode()) % 1000,
                                  weight_version=str(version), top_p_replay=self.top_p_replay,
                                  routed_experts=self.routed_experts, api_key=self.api_key,
                                  weights=self.weights.starting_weights(version), run=self.weights.run_id,
                                  driver_node=self.weights.driver_node)
                actor = cls.remote(self.start_launch(launch))
                info = await actor.info.remote()
                url = info["url"]
        except Exception as e:  # noqa: BLE001 - a replica that cannot start is logged (and counted)
            self._starting[g.name] -= 1
            self._recount(g.name)
            error = f"{type(e).__name__}: {e}"
            ctx.event("crash", g.name, index, ctx.version, detail=f"start failed: {error}"[:2000])
            self._start_failed(g.name, error)
            return None
        finally:
            self.weights.unpin(version)
        self._start_failures[g.name] = 0
        client = client or self._client(url)
        served = version                              # an attached server too: it has just loaded it
        rep = Replica(group=g.name, index=index, url=url, client=client, actor=actor, version=served,
                      started_s=ctx.now(), node=info.get("node_id"))
        if info:
            if info.get("transfer_s") and self.weights.caches is not None:
                self.weights.caches.note_fetched(rep.node, version, info["transfer_s"])
            ctx.event("placed", g.name, index, version, detail=json.dumps(
                {"node": rep.node, "host": info.get("host"), "url": url, "accelerator": g.accelerator,
                 "amount": g.tp, "model_path": info.get("model_path"), "transfer_s": info.get("transfer_s"),
                 **({"attached": info["attached"]} if "attached" in info else {})}))
        if self.weights.version > served:             # a push landed while it started (or attached): catch up
            await self.weights.catch_up(rep)          # (still counted as starting: the monitor starts no other)
        self._starting[g.name] -= 1
        self.replicas[g.name].append(rep)
        self.cluster.placed(rep)
        self._recount(g.name)
        if cold:
            ctx.event("cold_start", g.name, index, ctx.version, duration_s=ctx.now() - t0)
        ctx.event("ready", g.name, index, ctx.version, detail=url, duration_s=ctx.now() - t0)
        ctx.wake.set()
        return rep

    def _client(self, url: str) -> SamplerClient:
        return SamplerClient(url, config=ClientConfig(max_retries=2, backoff_initial_s=0.05, connect_timeout_s=5.0),
                             api_key=self.api_key)

    def run_model(self) -> dict[str, Any]:
        """model_type / architectures of the run's base checkpoint (config.json), what an attached server must serve."""
        if self._run_model is None:
            cfg_path = Path(self.ctx.config.init_checkpoint) / "config.json"
            try:
                cfg = json.loads(cfg_path.read_text())
            except (OSError, ValueError):
                cfg = {}
            self._run_model = {k: cfg[k] for k in ("model_type", "architectures") if cfg.get(k)}
        return self._run_model

    async def _attach(self, client: SamplerClient, path: str, version: int) -> dict[str, Any]:
        """The checks an attached server passes before it is "ready" (module doc); raises AttachFailed with the
        reason. Returns the "placed" event's fields: what the server held, what it loaded."""
        url = client.base_url
        if self._probe_http is None:
            self._probe_http = httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False)
        deadline = self.ctx.now() + ATTACH_WAIT_S
        while True:
            try:
                status = (await self._probe_http.get(f"{url}/health")).status_code
                reason = f"/health answered HTTP {status}"
            except httpx.ConnectError as e:
                raise AttachFailed(f"{url}: nothing listens there (connection refused: {e})") from None
            except httpx.HTTPError as e:
                status, reason = 0, f"/health: {type(e).__name__}: {e}"
            if status == 200:
                break
            if self.ctx.now() >= deadline:
                raise AttachFailed(f"{url}: not a healthy sampler after {ATTACH_WAIT_S:.0f} s ({reason})")
            await asyncio.sleep(ATTACH_POLL_S)
        info = await client.model_info()
        if not isinstance(info, dict) or not info.get("is_generation", False):
            raise AttachFailed(f"{url}: /get_model_info does not describe a generation model: {str(info)[:200]}")
        for key, want in self.run_model().items():
            have = info.get(key)
            if have and have != want:
                raise AttachFailed(f"{url}: serves {key} {have!r}, the run trains {want!r} "
                                   f"({self.ctx.config.init_checkpoint}); attach servers of the run's model")
        held = {"weight_version": str(info.get("weight_version", "")), "model_path": str(info.get("model_path", ""))}
        res = await client.update_weights_from_disk(path, weight_version=str(version))
        if not res.get("success"):
            why = res.get("message") or res.get("error") or res
            raise AttachFailed(f"{url}: did not load the run's weights (version {version}, {path}): {str(why)[:300]}")
        now = await client.weight_version()
        if now != str(version):
            raise AttachFailed(f"{url}: reports weight_version {now!r} after loading the run's version {version}")
        return {"host": urlsplit(url).hostname, "url": url, "model_path": path,
                "attached": {"held_weight_version": held["weight_version"], "held_model_path": held["model_path"],
                             **{k: info.get(k) for k in ("model_type", "architectures") if info.get(k)}}}

    def _start_failed(self, group: str, error: str) -> None:
        """One more failed start of `group`; `MAX_START_FAILURES` in a row with nothing up or starting: the
        group cannot start (the run fails, or the group is given up when the run allows it)."""
        self._start_failures[group] += 1
        if self._start_failures[group] < MAX_START_FAILURES or group in self.lost_groups:
            return
        if any(r.up for r in self.replicas[group]) or self._starting[group] > 0:
            return
        last = _last_line(error)
        if self.ctx.config.allow_group_loss:
            self.lost_groups[group] = last
            self.ctx.event("group_lost", group, version=self.ctx.version, detail=json.dumps(
                {"starts_failed": self._start_failures[group], "error": last}))
            self.ctx.wake.set()
            if set(self.lost_groups) == set(self.names):
                self.ctx.fail(RunFailed(f"no sampler group can start (the last, {group!r}: {last})"))
            return
        self.ctx.fail(RunFailed(
            f"sampler group {group!r} cannot start: {self._start_failures[group]} starts in a row failed, the "
            f"last with {last} (see its 'crash' events); fix the group in the plan, or allow going on without "
            f"it (--allow-group-loss)"))

    # ---- accounting and views ---------------------------------------------------------------------------
    def held(self, group: str) -> int:
        """Replicas of `group` up or starting (what it holds of its accelerator now)."""
        return self._starting[group] + sum(1 for r in self.replicas[group] if r.up)

    def _recount(self, group: str) -> None:
        """The group's replicas up / billed (up or starting) changed: integrate the old levels to now."""
        up = sum(1 for r in self.replicas[group] if r.up)
        self._replica_s[group].set(self.ctx.now(), up, up + self._starting[group])

    def totals(self, group: str, now: float, tokens_generated: int) -> GroupTotals:
        """The group's running totals for the run log (costmodel/records/ledger.py)."""
        rs = self._replica_s[group]
        rs.advance(now)
        return GroupTotals(up_replica_s=rs.up_s, cost_usd=self.groups[group].usd_per_hour * rs.billed_s / 3600.0,
                           busy_s=self._busy_gone_s[group] + sum(r.busy_until(now) for r in self.replicas[group]),
                           tokens_generated=tokens_generated)

    def group_view(self, name: str) -> GroupView:
        g, now = self.groups[name], self.ctx.now()
        reps = tuple(ReplicaView(index=r.index, up=r.up and r.admitting.is_set(),
                                 outstanding_tokens=r.outstanding_tokens, running=r.running,
                                 sessions=self.router.pinned(name, r.index),
                                 busy_s=r.busy_until(now)) for r in self.replicas[name])
        starting = tuple(ReplicaView(index=-1 - i, up=False, starting=True) for i in range(self._starting[name]))
        live_versions = [r.version for r in self.replicas[name] if r.up]
        return GroupView(name=name, capacity_tokens_per_s=g.capacity_tokens_per_s, usd_per_hour=g.usd_per_hour,
                         usd_per_mtoken=g.usd_per_mtoken, replicas=reps + starting, min_replicas=g.min_replicas,
                         max_replicas=g.max_replicas, configured_replicas=g.replicas,
                         weight_version=min(live_versions) if live_versions else self.ctx.version)

    def fleet_view(self) -> FleetView:
        return FleetView(now_s=self.ctx.now(), groups=tuple(self.group_view(n) for n in self.names))

    # ---- faults -----------------------------------------------------------------------------------------
    async def probe(self, rep: Replica) -> bool | None:
        """True: /health answers 200; False: nothing listens (connection refused) or its actor is gone;
        None: no answer in time (a busy machine), undecided."""
        if self._probe_http is None:
            self._probe_http = httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False)
        try:
            resp = await self._probe_http.get(f"{rep.url}/health")
            return resp.status_code == 200 or None
        except httpx.ConnectError:
            return False
        except httpx.HTTPError:
            return None

    def lost(self, rep: Replica, reason: str) -> None:
        """Mark a replica down (event "crash"); its process is killed so a hung one does not linger."""
        if not rep.up:
            return
        rep.up = False
        self._recount(rep.group)
        self.ctx.event("crash", rep.group, rep.index, rep.version, detail=reason[:300])
        self.ctx.spawn(rep.client.aclose())
        if rep.actor is not None:
            import ray

            with contextlib.suppress(Exception):
                ray.kill(rep.actor, no_restart=True)
        self.ctx.wake.set()

    def kill(self, group: str, index: int | None = None) -> int:
        """Kill one sampler replica's process (the CLI's --kill-at fault drill); returns its index."""
        import ray

        reps = [r for r in self.replicas[group] if r.up and (index is None or r.index == index)]
        if not reps:
            raise ValueError(f"kill_replica: no live replica {index} in group {group!r}")
        rep = reps[0]
        if rep.actor is not None:
            ray.kill(rep.actor, no_restart=True)
        return rep.index

    # ---- the monitor: the autoscaler's target, lost replicas replaced -------------------------------------
    async def monitor(self) -> None:
        ctx = self.ctx
        interval = min(max(float(getattr(self.autoscaler.config, "interval_s", 5.0)), MONITOR_INTERVAL_S), 5.0)
        while not ctx.stopping:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            now = ctx.now()
            if self.spec.mode != "attach":
                self.cluster.check_nodes()
            for name, reps in self.replicas.items():
                for rep in list(reps):       # probe replicas that look idle-but-up so a dead idle one is noticed
                    if rep.up and rep.actor is not None and rep.running == 0:
                        ok = await self.probe(rep)
                        rep.failed_probes = 0 if ok else rep.failed_probes + 1
                        if ok is False or rep.failed_probes >= MAX_FAILED_PROBES:
                            self.lost(rep, f"health check failed ({rep.failed_probes} probes)")
                for r in [r for r in reps if not r.up]:
                    self._busy_gone_s[name] += r.busy_until(now)
                    reps.remove(r)
            if now - self._last_scale_check < interval:
                continue
            self._last_scale_check = now
            for g in self.spec.groups:
                if g.name in self.lost_groups:
                    continue
                view = self.group_view(g.name)
                want = self.autoscaler.target(view, now)
                live = view.live_replicas
                lost = g.replicas - live
                if want > live and self.spec.mode != "attach":
                    want = min(want, live + self.cluster.room(g))
                if want > live:
                    for _ in range(want - live):
                        kind = "restart" if lost > 0 else "scale_up"
                        lost -= 1
                        ctx.event(kind, g.name, self._next_index[g.name], ctx.version)
                        ctx.spawn(self.start(g, cold=True))
                elif want < live:
                    for rep in sorted(self.replicas[g.name], key=lambda r: (r.running, -r.index))[: live - want]:
                        ctx.spawn(self.retire(rep))

    async def retire(self, rep: Replica) -> None:
        self.cluster.retired(rep)
        rep.admitting.clear()
        self.ctx.event("scale_down", rep.group, rep.index, rep.version)
        while rep.running:
            await asyncio.sleep(0.1)
        rep.up = False
        self._recount(rep.group)
        if rep.actor is not None:
            with contextlib.suppress(Exception):
                await rep.actor.stop.remote()
            import ray

            ray.kill(rep.actor, no_restart=True)
        await rep.client.aclose()

    # ---- the end ------------------------------------------------------------------------------------------
    async def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by each live sampler process ("group#index")."""
        out = {}
        for g, reps in self.replicas.items():
            for r in reps:
                if r.up and r.actor is not None:
                    with contextlib.suppress(Exception):
                        out[f"{g}#{r.index}"] = float(await asyncio.wait_for(r.actor.cpu_s.remote(), 10))
        return out

    async def close(self) -> None:
        import ray

        for reps in self.replicas.values():
            for r in reps:
                with contextlib.suppress(Exception):
                    await r.client.aclose()
                if r.actor is not None:
                    with contextlib.suppress(Exception):
                        ray.kill(r.actor, no_restart=True)
        if self._probe_http is not None:
            await self._probe_http.aclose()


class AttachFailed(RuntimeError):
    """An attached server failed its checks (the reason in the message): a failed start of its group."""


def _last_line(error: str, limit: int = 400) -> str:
    """The gist of an actor's start error (Ray wraps it with its traceback): its last non-empty line."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else error)[:limit]
