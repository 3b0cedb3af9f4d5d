"""The simulated world: sampler groups of processor-sharing replicas, sessions, the buffer, costs.

`World` holds the state and the event handlers; `run_loop` (bottom) is the algorithm a run follows.
The hot path, the sessions' turn cycle (tool calls ending, replica wake-ups), is `twin.core.Turns`: bare
entries in SimPy's queue with plain callbacks (`twin.engine`, the one place that touches SimPy's internals; a
session is its own entry and its own replica request), so a turn costs about two events and allocates nothing;
the trainer, autoscaler and fault injection are SimPy processes. Policies
(router, autoscaler, batcher, weight sync) are the plan's objects from mixfleet.policies, fed read-only views.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.ledger import GroupBatch, GroupTotals, Ledger, weight_push_detail
from mixfleet.costmodel.records.runlog import EventRecord, TrajectoryRecord
from mixfleet.costmodel.specs.workload import WorkloadSpec
from mixfleet.policies.prompt_buffer import PromptBuffer, PromptGroup
from mixfleet.policies.views import FleetView, GroupView, ReplicaView
from mixfleet.twin.core import Replica, ReplicaRates, Session, Turns
from mixfleet.twin.engine import TwinEnvironment
from mixfleet.twin.episodes import draw_episodes


@dataclass(frozen=True, kw_only=True)
class GroupSetup:
    """What the world needs to know about one group (from the plan and the cost model)."""
    name: str
    rates: ReplicaRates              # per replica
    replicas: int
    min_replicas: int
    max_replicas: int
    capacity_tokens_per_s: float     # nominal throughput of one replica (routing weights)
    usd_per_mtoken: float
    weight_sync_s: float             # push time of one new version to this group
    kl_k3: float = math.nan          # mismatch prior (per token, vs the trainer)
    extreme_share: float = math.nan  # prior share of tokens with ratio outside [0.2, 5]
    kl_growth_per_version: float = 0.0  # relative KL growth per version of staleness
    preemptions_per_replica_hour: float = 0.0  # a spot group's own rate, on top of the plan's [faults] rate


@dataclass(frozen=True, kw_only=True)
class TrainerSetup:
    train_step_s: Callable[[int], float]  # seconds for an update of this many generated tokens
    usd_per_hour: float


@dataclass(eq=False)
class Group:
    setup: GroupSetup
    replicas: list[Replica] = field(default_factory=list)   # up or starting
    retired: list[Replica] = field(default_factory=list)    # stopped or lost (for totals)
    weight_version: int = 0
    next_index: int = 0
    cost_usd: float = 0.0
    up_s: float = 0.0                # replica-seconds up
    last_s: float = 0.0
    samples: int = 0

    def accrue(self, now_s: float) -> None:
        """Bill every live replica (up or cold-starting) up to now."""
        dt = now_s - self.last_s
        if dt > 0:
            self.cost_usd += len(self.replicas) * self.setup.rates.price_usd_per_hour / 3600.0 * dt
            self.up_s += sum(1 for r in self.replicas if r.up) * dt
            self.last_s = now_s


@dataclass(eq=False)
class SandboxPool:
    """The plan's sandboxes (costmodel's `ResolvedSandbox`): an episode takes one when it begins, or waits in
    FIFO order while `max_live` are live; it starts for `start_s`, then the episode's turns and commands run in
    it; it is given back when the episode's last turn ends. Every live sandbox (starting included) is billed
    at `usd_per_hour`. Per session (by sid): when it asked, when it got its sandbox; per finished one, its
    (wait, held) seconds until its trajectory is written."""
    max_live: int
    start_s: float
    usd_per_hour: float
    live: int = 0
    live_s: float = 0.0              # sandbox-seconds so far
    last_s: float = 0.0
    waiting: deque = field(default_factory=deque)
    asked_s: dict[int, float] = field(default_factory=dict)
    got_s: dict[int, float] = field(default_factory=dict)
    done: dict[int, tuple[float, float]] = field(default_factory=dict)

    def accrue(self, now_s: float) -> None:
        dt = now_s - self.last_s
        if dt > 0:
            self.live_s += self.live * dt
            self.last_s = now_s

    @property
    def cost_usd(self) -> float:
        return self.live_s * self.usd_per_hour / 3600.0


class World:
    """State + handlers. Build with `World(...)`, then `env.process(run_loop(world, updates))`."""

    def __init__(self, *, groups: list[GroupSetup], trainer: TrainerSetup, workload: WorkloadSpec,
                 policies: dict[str, Any], seed: int, writer: Any, run_id: str,
                 preemptions_per_replica_hour: float = 0.0, on_loss: str = "resume",
                 progress: Callable[[int], None] | None = None, sandbox: Any = None) -> None:
        self.env = TwinEnvironment()
        self.groups = {g.name: Group(setup=g) for g in groups}
        self.trainer = trainer
        self.workload = workload
        self.router, self.autoscaler = policies["router"], policies["autoscaler"]
        self.batcher, self.weight_sync = policies["batcher"], policies["weight_sync"]
        self.rng = np.random.default_rng(seed)
        self.fault_rng = np.random.default_rng([seed, 1])
        self.writer, self.run_id, self.progress = writer, run_id, progress
        self.fault_rate_h, self.on_loss = preemptions_per_replica_hour, on_loss
        self.version = 0
        self.prompts: PromptBuffer[Session] = PromptBuffer(self.batcher,
                                                           lambda s: min(s.tokens_by_version, default=None))
        self.sessions_started = 0
        self.trajectories_written = 0
        self.trajectories_dropped = 0
        self.parked: list[Session] = []  # sessions waiting for any replica to be up
        self._batch_waiter: simpy.Event | None = None
        self._fleet_view: FleetView | None = None
        self.ledger = Ledger(list(self.groups), trainer.usd_per_hour)
        self.trainer_busy_s = 0.0
        self.stalled: SpecError | None = None
        self.warm_started: set[int] = set()     # sessions begun before the run (mid-episode at its start)
        # the plan's sandboxes (costmodel.plan.planspec.ResolvedSandbox), or None: no pool, no start, no cost
        self.sandbox = (SandboxPool(max_live=sandbox.max_live, start_s=sandbox.start_s,
                                    usd_per_hour=sandbox.usd_per_hour) if sandbox is not None else None)
        self.turns = Turns(self.env, self, restart=on_loss == "restart")
        self._turn, self.poke = self.turns.turn, self.turns.poke
        for g in self.groups.values():
            for _ in range(g.setup.replicas):
                self._new_replica(g, up=True)

    # ---- views for the policies ------------------------------------------------------------------
    def group_view(self, g: Group) -> GroupView:
        reps = tuple(ReplicaView(index=r.index, up=r.up, starting=not r.up, outstanding_tokens=r.outstanding_tokens,
                                 running=len(r.running), waiting=len(r.waiting), busy_s=r.busy_s,
                                 idle_since_s=r.idle_since_s) for r in g.replicas)
        s = g.setup
        return GroupView(name=s.name, capacity_tokens_per_s=s.capacity_tokens_per_s,
                         usd_per_hour=s.rates.price_usd_per_hour, usd_per_mtoken=s.usd_per_mtoken, replicas=reps,
                         min_replicas=s.min_replicas, max_replicas=s.max_replicas, configured_replicas=s.replicas,
                         cold_start_s=s.rates.cold_start_s, weight_version=g.weight_version)

    def fleet_view(self) -> FleetView:
        if self._fleet_view is None or getattr(self.router, "uses_load", True):
            self._fleet_view = FleetView(now_s=self.env.now, groups=tuple(self.group_view(g)
                                                                         for g in self.groups.values()))
        return self._fleet_view

    def event(self, kind: str, group: str = "", replica: int = -1, version: int = -1, detail: str = "",
              duration_s: float = math.nan) -> None:
        self.writer.append(EventRecord(time_s=self.env.now, kind=kind, group=group, replica=replica,
                                       version=version, detail=detail, duration_s=duration_s))

    # ---- replicas ----------------------------------------------------------------------------------
    def _new_replica(self, g: Group, up: bool) -> Replica:
        rep = Replica(g.setup.name, g.next_index, g.setup.rates, version=g.weight_version)
        rep.t_s = rep.stall_until_s = self.env.now
        rep.up = up
        g.next_index += 1
        g.replicas.append(rep)
        self._fleet_view = None
        return rep

    def lose_replica(self, g: Group, rep: Replica, kind: str) -> None:
        """Preemption / crash: bill to now, drop it, hand its requests back to their sessions."""
        g.accrue(self.env.now)
        lost = rep.lose(self.env.now)
        g.replicas.remove(rep)
        g.retired.append(rep)
        self._fleet_view = None
        self.event(kind, g.setup.name, rep.index)
        for req in lost:
            self.turns.turn_done(req, False)

    def start_replica(self, g: Group) -> Generator:
        """Scale up: a cold start (billed), then the replica serves the group's newest weights."""
        g.accrue(self.env.now)
        rep = self._new_replica(g, up=False)
        cold = g.setup.rates.cold_start_s
        self.event("cold_start", g.setup.name, rep.index, duration_s=cold)
        yield self.env.timeout(cold)
        if rep not in g.replicas:
            return
        g.accrue(self.env.now)
        rep.up, rep.version, rep.draining, rep.pending = True, g.weight_version, False, None
        rep.t_s = rep.stall_until_s = self.env.now
        self._fleet_view = None
        self.event("ready", g.setup.name, rep.index, version=g.weight_version)
        parked, self.parked = self.parked, []
        for s in parked:
            self._turn(s)

    def stop_replica(self, g: Group) -> None:
        """Scale down: stop a starting replica, else the idle one with the fewest sessions."""
        starting = [r for r in g.replicas if not r.up]
        idle = sorted((r for r in g.replicas if r.up and not r.running and not r.waiting),
                      key=lambda r: (self.router.pinned(g.setup.name, r.index), -r.index))
        victim = starting[-1] if starting else (idle[0] if idle else None)
        if victim is None and getattr(self.autoscaler, "stops_busy", False):
            # the re-planner (policies.replan) stops the least loaded replica now: its requests resume elsewhere
            busy = [r for r in g.replicas if r.up]
            if busy:
                self.lose_replica(g, min(busy, key=lambda r: (r.outstanding_tokens, -r.index)), "scale_down")
            return
        if victim is None:
            return
        g.accrue(self.env.now)
        victim.lose(self.env.now)
        g.replicas.remove(victim)
        g.retired.append(victim)
        self._fleet_view = None
        self.event("scale_down", g.setup.name, victim.index)

    # ---- sessions ----------------------------------------------------------------------------------
    def admit_prompts(self) -> None:
        """Start as many new prompt-groups as the batcher allows (each: samples_per_prompt sessions)."""
        spp = self.prompts.samples_per_prompt
        for p in self.prompts.admit(self.version):
            pid = p.prompt_id
            for i, ep in enumerate(draw_episodes(self.workload, self.rng, spp)):
                s = Session(sid=pid * spp + i, prompt_id=pid, sample=i, ep=ep)
                self.sessions_started += 1
                self._begin(s)

    def seed_steady_state(self) -> None:
        """Warm start: begin near the steady state instead of with K fresh prompt-groups in lockstep.

        In steady state the K prompt-groups in flight started at a constant rate, so their ages are uniform
        over a group's lifetime, K / B updates (Little's law). Each group drawn here gets an age u x (its
        longest sample's turns), u uniform: a sample with fewer turns has finished and waits for its siblings,
        the others have done floor(age) turns (their context and prefix cache on their routed replica as if
        served there) and resume after a uniform part of their tool call. Their earlier tokens get the versions
        the lifetime implies: a token (age - t - 1/2) / longest x K / B updates old has version V0 - ceil(that),
        with the run starting at version V0 = ceil(K / B) + 1 (so every version is >= 1; the first update is
        V0 + 1; prompt ids start at V0 x B, as if V0 updates had been trained). The buffer starts empty (the
        phase right after the trainer took a batch)."""
        spp, ppu = self.prompts.samples_per_prompt, self.prompts.prompts_per_update
        v0 = math.ceil(self.batcher.config.inflight_prompts / ppu) + 1
        self.version = v0
        self.prompts.started = self.prompts.taken = v0 * ppu  # as if v0 updates had been trained (admission limits)
        groups = self.prompts.admit(v0)
        life = len(groups) / ppu
        for g in self.groups.values():
            g.weight_version = v0
            for rep in g.replicas:
                rep.version = v0
        for p in groups:
            eps = draw_episodes(self.workload, self.rng, spp)
            longest = max(ep.turns for ep in eps)
            age = float(self.rng.random()) * longest
            for i, ep in enumerate(eps):
                smp = Session(sid=p.prompt_id * spp + i, prompt_id=p.prompt_id, sample=i, ep=ep)
                self.sessions_started += 1
                done = min(int(age), ep.turns)
                if done == 0:
                    self._begin(smp)
                    continue
                self.warm_started.add(smp.sid)      # its span holds only part of its tool time: not logged
                rep = self.route_session(smp)
                tbv: dict[int, int] = {}
                for t in range(done):
                    v = v0 - math.ceil((age - t - 0.5) / longest * life)
                    tbv[v] = tbv.get(v, 0) + ep.reply_tokens[t]
                smp.tokens_by_version, smp.replica, smp.cached_on, smp.turn = tbv, rep, rep, done
                smp.prompt_total = ep.prompt_tokens + sum(ep.tool_tokens[:done])
                if done == ep.turns:  # finished before the start: waits for its siblings
                    self.router.release(smp.sid)
                    self.prompts.finish(p, smp, 0.0)
                    continue
                if self.sandbox is not None:  # mid-episode: its sandbox started before the run did
                    self._take_sandbox(smp, start=False)
                smp.context = ep.prompt_tokens + sum(ep.reply_tokens[:done]) + sum(ep.tool_tokens[:done - 1])
                smp.pending_new, smp.remaining_reply = ep.tool_tokens[done - 1], ep.reply_tokens[done]
                smp.callbacks = self.turns.tool_cbs
                self.env.push(float(self.rng.random()) * ep.tool_s[done - 1], smp)

    def _begin(self, s: Session) -> None:
        pool = self.sandbox
        if pool is None or s.sid in pool.got_s:  # no sandboxes, or a restart in the sandbox it holds
            self._first_turn(s, self.env.now)
            return
        pool.asked_s[s.sid] = self.env.now
        if pool.live < pool.max_live:
            self._take_sandbox(s)
        else:
            pool.waiting.append(s)  # the cap binds: it waits for a sandbox given back (`_give_back_sandbox`)

    def _first_turn(self, s: Session, start_s: float) -> None:
        s.turn, s.context, s.pending_new = 0, 0, s.ep.prompt_tokens
        s.remaining_reply, s.prompt_total = s.ep.reply_tokens[0], s.ep.prompt_tokens
        s.tokens_by_version, s.start_s, s.cached_on, s.replica = {}, start_s, None, None
        self._turn(s)

    def _take_sandbox(self, s: Session, start: bool = True) -> None:
        """`s` gets a sandbox now; with `start`, its first turn follows the sandbox's start latency."""
        pool, now = self.sandbox, self.env.now
        pool.accrue(now)
        pool.live += 1
        pool.got_s[s.sid] = now
        if not start:
            pool.asked_s[s.sid] = now
            return
        asked = pool.asked_s[s.sid]
        if pool.start_s > 0:
            self.env.timeout(pool.start_s).callbacks.append(lambda _e, s=s, t=asked: self._first_turn(s, t))
        else:
            self._first_turn(s, asked)

    def _give_back_sandbox(self, s: Session) -> None:
        """`s` finished: its sandbox goes back to the pool (the next waiting episode takes it)."""
        pool, now = self.sandbox, self.env.now
        pool.accrue(now)
        pool.live -= 1
        got = pool.got_s.pop(s.sid)
        pool.done[s.sid] = (got - pool.asked_s.pop(s.sid), now - got)
        while pool.waiting and pool.live < pool.max_live:
            self._take_sandbox(pool.waiting.popleft())

    @property
    def sessions_lost(self) -> int:
        """Turns cut by a replica loss (each resumed or restarted)."""
        return self.turns.sessions_lost

    @property
    def sessions_restarted(self) -> int:
        return self.turns.sessions_restarted

    def route_session(self, s: Session) -> Replica | None:
        """The router's replica for a new session, or one whose pinned replica is gone (None: parked until
        a replica is up)."""
        route = self.router.route(s.sid, self.fleet_view())
        if route is None:
            self.parked.append(s)
            return None
        return next(r for r in self.groups[route[0]].replicas if r.index == route[1])

    def restart(self, s: Session) -> None:
        """A trajectory cut by a replica loss starts over (faults.on_loss = "restart")."""
        self.router.release(s.sid)
        self._begin(s)

    def session_finished(self, s: Session) -> None:
        """Its last turn is done: into its prompt-group; a complete group may form an update."""
        s.end_s = self.env.now
        self.router.release(s.sid)
        if self.sandbox is not None:
            self._give_back_sandbox(s)
        if self.prompts.finish(self.prompts.inflight[s.prompt_id], s, self.env.now):
            if self._batch_waiter is not None and self.prompts.can_decide:
                self._batch_waiter.succeed()
                self._batch_waiter = None
            self.admit_prompts()

    # ---- the trainer's side ------------------------------------------------------------------------
    def wait_for_batch(self) -> Generator:
        """Block until the batcher forms an update; returns its prompt-groups (dropped ones are logged)."""
        while True:
            batch, dropped = self.prompts.decide(self.env.now, self.version)
            for p in dropped:
                for s in p.samples:
                    self.write_trajectory(s, trained_version=-1)
                    self.trajectories_dropped += 1
            if dropped:
                self.admit_prompts()
            if batch is not None:
                return batch
            self._batch_waiter = self.env.event()
            yield self._batch_waiter
            if self.stalled is not None:
                return None

    def push_weights(self, version: int) -> float:
        """Start the new version's push to every group the weight-sync policy picks; returns the
        trainer's blocking time (the slowest push)."""
        slowest = 0.0
        for g in self.groups.values():
            decision = self.weight_sync.decide(self.group_view(g), version, self.env.now)
            if not decision.push:
                continue
            sync_s = g.setup.weight_sync_s
            slowest = max(slowest, sync_s)
            up = sum(1 for rep in g.replicas if rep.up)  # a replica still cold-starting loads them when ready
            self.event("weight_push", g.setup.name, version=version, duration_s=sync_s,
                       detail=weight_push_detail("drain" if decision.drain else "in_flight", up, up))
            if decision.drain:
                for rep in g.replicas:
                    if rep.up:  # a replica still cold-starting loads the newest weights when it is ready
                        rep.draining, rep.pending = True, (version, self.env.now + sync_s)
            self.env.timeout(sync_s).callbacks.append(lambda _e, g=g, v=version: self._land(g, v))
        return slowest

    def _land(self, g: Group, version: int) -> None:
        g.weight_version = max(g.weight_version, version)
        now = self.env.now
        for rep in g.replicas:
            if not rep.up:
                continue
            if rep.draining:
                self.turns.maybe_load(rep)
            else:
                rep.set_version(version, now)
            self.poke(rep)

    def write_trajectory(self, s: Session, trained_version: int) -> None:
        tbv = {v: n for v, n in s.tokens_by_version.items() if n}
        waited = math.nan
        if self.sandbox is not None:
            waited = self.sandbox.done.pop(s.sid, (math.nan, math.nan))[0]
        # seconds of its span in its tools, as a real run logs them (sandbox wait and start, the commands): what the
        # calibration's duration fit takes out of the span; unknown for a session begun before the run or restarted
        tool_s = math.nan
        if s.sid not in self.warm_started and not s.restarts:
            tool_s = float(sum(s.ep.tool_s)) + (0.0 if self.sandbox is None else waited + self.sandbox.start_s)
        self.warm_started.discard(s.sid)
        self.writer.append(TrajectoryRecord(
            run_id=self.run_id, prompt_id=str(s.prompt_id), sample_index=s.sample,
            group=s.replica.group if s.replica else "", replica=s.replica.index if s.replica else -1,
            version_start=min(tbv, default=0), version_end=max(tbv, default=0), turns=s.ep.turns,
            prompt_tokens=s.prompt_total, generated_tokens=sum(tbv.values()), start_s=s.start_s, end_s=s.end_s,
            reward=s.ep.reward, finish_reason=s.ep.finish_reason, restarts=s.restarts, tokens_by_version=tbv,
            trained_version=trained_version, sandbox_wait_s=waited, tool_s=tool_s))
        self.trajectories_written += 1

    def record_update(self, batch: list[PromptGroup[Session]], version: int, start_s: float, train_s: float,
                      sync_s: float) -> None:
        """The update's row and its groups' rows (costmodel/records/ledger.py), and its trajectories' rows."""
        now = self.env.now
        sessions = [s for p in batch for s in p.samples]
        versions, counts, by_group = [], [], {}
        sandbox: dict[str, Any] = {}
        if self.sandbox is not None:  # the batch's pool waits and sandbox time (before write_trajectory pops them)
            pool = self.sandbox
            pool.accrue(now)
            spans = [pool.done.get(s.sid, (0.0, 0.0)) for s in sessions]
            sandbox = {"cost_sandbox_usd": pool.cost_usd, "sandbox_wait_s": float(sum(w for w, _ in spans)),
                       "sandbox_s": float(sum(h for _, h in spans))}
        for s in sessions:
            g = s.replica.group
            for v, n in s.tokens_by_version.items():
                versions.append(v)
                counts.append(n)
                by_group.setdefault(g, [0, 0, 0.0, 0])
                by_group[g][1] += n
                by_group[g][2] += n * ((version - 1) - v)
                if v == version - 1:
                    by_group[g][3] += n       # on-policy
            by_group.setdefault(g, [0, 0, 0.0, 0])[0] += 1
            self.write_trajectory(s, trained_version=version)
        stal = (version - 1) - np.asarray(versions, dtype=np.float64)
        w = np.asarray(counts, dtype=np.float64)
        order = np.argsort(stal, kind="stable")
        cum = np.cumsum(w[order]) / max(w.sum(), 1.0)
        q = lambda x: float(stal[order][min(np.searchsorted(cum, x), len(cum) - 1)]) if len(cum) else 0.0  # noqa: E731
        tokens = int(w.sum())
        kl_sum = ext_sum = 0.0
        for g in self.groups.values():
            g.accrue(now)
            for rep in g.replicas:
                rep.advance_to(now)
        totals, batches = {}, {}
        for name, g in self.groups.items():
            st = g.setup
            n_samples, n_tok, stale_sum, n_fresh = by_group.get(name, (0, 0, 0.0, 0))
            g.samples += n_samples
            stale_mean = stale_sum / n_tok if n_tok else math.nan
            growth = 1.0 + st.kl_growth_per_version * (stale_mean if n_tok else 0.0)  # the prior's staleness growth
            kl, ext_g = st.kl_k3 * growth, min(1.0, st.extreme_share * growth)
            kl_sum += kl * n_tok if n_tok else 0.0
            ext_sum += ext_g * n_tok if n_tok else 0.0
            totals[name] = GroupTotals(up_replica_s=g.up_s, cost_usd=g.cost_usd,
                                       busy_s=sum(r.busy_s for r in g.replicas + g.retired),
                                       tokens_generated=sum(r.tokens_generated for r in g.replicas + g.retired))
            batches[name] = GroupBatch(samples=n_samples, tokens_trained=int(n_tok), staleness_mean=stale_mean,
                                       kl_k3=kl if n_tok else math.nan, extreme_share=ext_g if n_tok else math.nan,
                                       kl_k3_on_policy=st.kl_k3 if n_fresh else math.nan, tokens_on_policy=n_fresh)
        self.trainer_busy_s += train_s + sync_s
        update, rows = self.ledger.record(
            version=version, now_s=now, start_s=start_s, totals=totals, batches=batches, train_step_s=train_s,
            weight_sync_s=sync_s, tokens=tokens, trajectories=len(sessions),
            staleness={"staleness_mean": float((stal * w).sum() / max(w.sum(), 1.0)), "staleness_p50": q(0.5),
                       "staleness_p95": q(0.95), "staleness_max": float(stal.max()) if len(stal) else 0.0},
            kl_k3=kl_sum / tokens if tokens else math.nan, extreme_share=ext_sum / tokens if tokens else math.nan,
            reward_mean=float(np.mean([s.ep.reward for s in sessions])), **sandbox)
        self.writer.extend(rows)
        self.writer.append(update)

    # ---- background processes ----------------------------------------------------------------------
    def autoscale_loop(self) -> Generator:
        """Every interval: each group to the autoscaler's target (scale-ups pay a cold start)."""
        while True:
            yield self.env.timeout(self.autoscaler.config.interval_s)
            ppu = self.prompts.prompts_per_update
            inflight, complete = len(self.prompts.inflight), len(self.prompts.complete)
            starved = not inflight and not self.parked
            if self._batch_waiter is not None and (starved or complete > 10 * ppu):
                self.stalled = SpecError("policies.batcher", "settings", self.batcher.config,
                                         f"settings under which updates form: the trainer waits, {inflight} "
                                         f"prompts are generating and the buffer holds {complete} "
                                         f"prompt-groups ({ppu} per update)")
                waiter, self._batch_waiter = self._batch_waiter, None
                waiter.succeed()  # wakes the run loop, which stops
                return
            for g in self.groups.values():
                target = self.autoscaler.target(self.group_view(g), self.env.now)
                for _ in range(target - len(g.replicas)):
                    self.event("scale_up", g.setup.name)
                    self.env.process(self.start_replica(g))
                for _ in range(len(g.replicas) - target):
                    self.stop_replica(g)

    def fault_rate_of(self, g: Group) -> float:
        """Preemptions per replica-hour of a replica of `g`: the plan's [faults] rate plus a spot group's own."""
        return self.fault_rate_h + g.setup.preemptions_per_replica_hour

    def fault_loop(self) -> Generator:
        """Preemptions: a Poisson process over the replicas up, each at its group's rate per replica-hour
        (`fault_rate_of`); the victim drawn in proportion to its rate (uniform when all rates are equal)."""
        while True:
            rates = [self.fault_rate_of(g) for g in self.groups.values() for r in g.replicas if r.up]
            equal = all(x == rates[0] for x in rates)
            total_h = (rates[0] * len(rates) if equal else sum(rates)) if rates else 0.0
            if total_h <= 0:   # none up (or only replicas that are never preempted): as if one of the most at risk
                total_h = max(self.fault_rate_of(g) for g in self.groups.values())
            yield self.env.timeout(float(self.fault_rng.exponential(1.0 / (total_h / 3600.0))))
            ups = [(g, r) for g in self.groups.values() for r in g.replicas if r.up]
            if not ups:
                continue
            rates = [self.fault_rate_of(g) for g, _ in ups]
            if all(x == rates[0] for x in rates):
                i = int(self.fault_rng.integers(len(ups)))
            else:
                i = int(np.searchsorted(np.cumsum(rates), self.fault_rng.random() * sum(rates), side="right"))
                i = min(i, len(ups) - 1)
            if rates[i] > 0:
                self.lose_replica(*ups[i], "preempt")


def run_loop(w: World, updates: int, warm_start: bool = False) -> Generator:
    """The algorithm of a fully asynchronous RL run, as the twin plays it:
    keep the samplers busy; then, per update: wait for a batch, train on it, push the new weights.
    warm_start: begin near the steady state (`World.seed_steady_state`) instead of from empty pipelines."""
    if warm_start:
        w.seed_steady_state()  # the run starts at version V0 > 0 (see there)
    else:
        w.admit_prompts()
    w.env.process(w.autoscale_loop())
    if any(w.fault_rate_of(g) > 0 for g in w.groups.values()):
        w.env.process(w.fault_loop())
    v0 = w.version
    for version in range(v0 + 1, v0 + updates + 1):
        batch = yield from w.wait_for_batch()
        if batch is None:  # stalled: the batcher never forms an update (simulate raises w.stalled)
            return
        start_s = w.env.now
        tokens = sum(n for p in batch for s in p.samples for n in s.tokens_by_version.values())
        train_s = w.trainer.train_step_s(tokens)
        yield w.env.timeout(train_s)
        sync_s = w.push_weights(version)
        yield w.env.timeout(sync_s)
        w.version = version
        w.record_update(batch, version, start_s, train_s, sync_s)
        w.admit_prompts()
        if w.progress is not None:
            w.progress(version - v0)
