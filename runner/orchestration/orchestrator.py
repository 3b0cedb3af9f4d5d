"""The real runner's loop: fully asynchronous RL over a mixed sampler fleet, with the plan's policies.

    while version < target:
        batch = await next_batch()        # batcher: oldest complete prompt-groups (sessions keep running)
        metrics = await train(batch)      # trainer actor: one optimizer step (samplers keep sampling)
        await push_weights(version)       # weight-sync policy per group; each group re-quantizes
        log_update(batch, metrics)        # run log: updates, groups, trajectories; then checkpoint

Around it, concurrently: a prompt feeder (the batcher's `admit` decides how many prompt-groups run at
once; unlimited staleness by default, so samplers never wait for the trainer), one asyncio task per
episode (runner/rollout/agent.py, token in / token out) whose every reply is routed by the plan's router
(session-sticky) to a sampler replica over HTTP, and a fleet monitor (the autoscaler's target per
group: replaces crashed replicas, scales up / down).

The policies are the very objects the twin uses (policies/), fed the same views (policies/views.py).
Synchronous mode (the benchmark's baseline) is the same loop with the batcher set to
`max_staleness = 0, stale = "wait"`: prompts of update v+1 start only once version v is pushed.

Faults: a replica whose HTTP connection fails is marked down (event "crash"); the sessions routed to it
are re-routed by the router (their turn re-runs on another replica, `restarts` counted in the
trajectory); the autoscaler's target brings a replacement (events "restart", "ready"). A weight load that
fails on a replica leaves it serving its previous version (event "weight_push_failed"). Resume: the run
log is cut back to the trainer checkpoint's version (`truncate_after_version`) and the loop continues
from it, so no update is duplicated or lost. The log records an update before the checkpoint is saved.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import shutil
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from mixfleet.costmodel.catalog import load_catalog
from mixfleet.costmodel.ledger import GroupBatch, GroupTotals, Ledger, trainer_usd_per_hour, weight_push_detail
from mixfleet.costmodel.runlog import EventRecord, RunLogWriter, TrajectoryRecord
from mixfleet.policies.plan import EmbeddedPlan, Plan
from mixfleet.policies.prompt_buffer import PromptBuffer, PromptGroup
from mixfleet.policies.views import FleetView, GroupView, ReplicaView
from mixfleet.runner.checkpoint.hf_checkpoint import load_config
from mixfleet.runner.orchestration.batching import BatchItem, BatchOptions, build_batch, group_metrics, version_int
from mixfleet.runner.orchestration.fleet import FleetSpec, GroupSpec, fleet_from_plan
from mixfleet.runner.rollout.agent import AgentConfig, Episode, run_episode
from mixfleet.runner.rollout.tasks import make_task
from mixfleet.runner.sampler.client import (
    ClientConfig,
    SamplerClient,
    SamplerHTTPError,
    SamplerUnavailable,
    routed_experts,
)
from mixfleet.runner.sampler.engine_api import RequestResult, SamplingParams, TokenOutput

RUN_MODES = ("async", "sync")
STATE_DIR = "trainer_state"
WEIGHTS_DIR = "weights"
ORCH_STATE_FILE = "orchestrator.json"
KEEP_WEIGHT_VERSIONS = 3
MONITOR_INTERVAL_S = 1.0           # the fleet monitor's tick; the autoscaler is asked every min(its interval, 5 s)
PROBE_TIMEOUT_S = 10.0             # a /health probe; no answer in time is "undecided", refused is "dead"
MAX_FAILED_PROBES = 5              # undecided probes in a row of an idle replica that count as a loss
MAX_SAME_REPLICA_RETRIES = 3       # per session: resends to a live replica after a dropped connection


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything a real run needs beyond the plan (validated on construction)."""

    out_dir: Path
    updates: int = 30                          # target trainer version
    init_checkpoint: str = ""                  # HF layout checkpoint of the base policy (samplers + trainer)
    mode: str = "async"                        # "async" (the seed) | "sync" (generate, then train)
    fleet_mode: str = "embedded"               # "embedded" | "sglang" | "attach" (runner/orchestration/fleet.py)
    attach: dict[str, list[str]] = field(default_factory=dict)
    address: str | None = None                 # Ray cluster address; None: a local Ray
    resume: bool = False
    task: str = "guess"
    task_options: dict[str, Any] = field(default_factory=dict)
    max_turns: int | None = None               # None: the plan's embedded.max_turns
    max_new_tokens: int | None = None          # None: the plan's embedded.max_new_tokens
    temperature: float | None = None
    top_k_record: int = 16                     # top-K log-probs recorded per sampled token (corrections' head)
    lr: float = 1e-4
    grad_clip_norm: float = 1.0
    trainer_threads: int = 1
    sampler_threads: int | None = None         # None: the plan's embedded.threads_per_replica
    eval_every: int | None = None              # None: the plan's embedded.eval_every (0 = never)
    eval_problems: int = 8
    pass_k: int | None = None
    eval_at_start: bool = True
    batcher_overrides: dict[str, Any] = field(default_factory=dict)
    inject_weight_load_failure: dict[str, list[int]] = field(default_factory=dict)  # group -> versions (tests)
    seed: int = 0
    ray_num_cpus: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        if self.mode not in RUN_MODES:
            raise ValueError(f"RunConfig.mode = {self.mode!r}; allowed: {', '.join(RUN_MODES)}")
        if not isinstance(self.updates, int) or self.updates < 1:
            raise ValueError(f"RunConfig.updates = {self.updates!r}; allowed: an integer >= 1")
        if not self.init_checkpoint:
            raise ValueError("RunConfig.init_checkpoint: required (a Hugging Face layout checkpoint folder)")
        for name in ("top_k_record", "trainer_threads", "eval_problems"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "top_k_record" else 1):
                lo = 0 if name == "top_k_record" else 1
                raise ValueError(f"RunConfig.{name} = {v!r}; allowed: an integer >= {lo}")
        if not self.lr > 0:
            raise ValueError(f"RunConfig.lr = {self.lr!r}; allowed: > 0")

    @classmethod
    def for_plan(cls, plan: Plan, **kw: Any) -> RunConfig:
        """A RunConfig from the plan's `[embedded.extra]` runner settings (e.g. lr, trainer_threads,
        eval_problems, top_k_record), then `kw` (explicit arguments win; None values are ignored)."""
        settable = {"lr", "grad_clip_norm", "trainer_threads", "sampler_threads", "eval_problems", "top_k_record",
                    "task_options", "max_turns", "max_new_tokens", "temperature", "eval_at_start"}
        extra = dict((plan.embedded.extra if plan.embedded is not None else {}) or {})
        for key in extra:
            if key not in settable:
                raise ValueError(f"plan '{plan.name}' [embedded.extra]: unknown runner setting {key!r}; "
                                 f"allowed: {', '.join(sorted(settable))}")
        extra.update({k: v for k, v in kw.items() if v is not None})
        return cls(**extra)


@dataclass
class Replica:
    group: str
    index: int
    url: str
    client: SamplerClient
    actor: Any = None                          # Ray actor handle (None when attached)
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


@dataclass
class Session:
    sid: int
    prompt_id: int
    sample_index: int
    session_id: str
    restarts: int = 0
    retries: int = 0                           # requests resent to the same (live) replica
    replica: int = -1
    group: str = ""


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


Sample = tuple[Session, Episode]            # a prompt-group's finished sample: the session and its episode


def _min_version(sample: Sample) -> int | None:
    """The oldest weight version of an episode's sampled tokens (None: none carries one)."""
    vs = [v for v in map(version_int, sample[1].tokens_by_version()) if v >= 0]
    return min(vs) if vs else None


@dataclass(frozen=True, kw_only=True)
class UpdateView:
    """What the live view shows after each update."""

    version: int
    target: int
    elapsed_s: float
    reward_mean: float
    kl_k3: float
    kl_by_group: dict[str, float]
    kl_on_policy_by_group: dict[str, float]      # staleness-0 tokens only: the precision mismatch
    staleness_mean: float
    staleness_max: float
    tokens_per_s: float
    pass_at_k: float
    restarts: int
    replicas_up: dict[str, int]
    trainer_idle_share: float


def _routed_shape(checkpoint: str) -> tuple[int, int] | None:
    """(num_hidden_layers, num_experts_per_tok) of a MoE checkpoint folder; None for a dense one or no folder."""
    if not checkpoint or not (Path(checkpoint) / "config.json").exists():
        return None
    cfg = load_config(checkpoint)
    return (cfg.num_hidden_layers, cfg.num_experts_per_tok) if cfg.is_moe else None


def result_from_response(resp: Mapping[str, Any], *, routed_shape: tuple[int, int] | None = None) -> RequestResult:
    """An SGLang /generate response (one item) -> the engine's RequestResult (what the agent loop consumes);
    with `routed_shape` (layers, top_k) its `meta_info.routed_experts` is decoded (start 0: every position)."""
    meta = resp.get("meta_info", {})
    ids = [int(i) for i in resp.get("output_ids", [])]
    lps = meta.get("output_token_logprobs") or [[0.0, i, None] for i in ids]
    tops = meta.get("output_top_logprobs") or [None] * len(ids)
    masks = meta.get("output_token_sampling_mask") or [None] * len(ids)
    mask_lps = meta.get("output_token_sampling_logprobs") or [None] * len(ids)
    vers = meta.get("output_token_weight_versions") or [str(meta.get("weight_version", "0"))] * len(ids)
    tokens = []
    for j, tid in enumerate(ids):
        top = [(float(t[0]), int(t[1])) for t in tops[j]] if tops[j] else []
        mids = list(masks[j]) if masks[j] is not None else None
        mlp = mask_lps[j] if isinstance(mask_lps[j], list) else None
        tokens.append(TokenOutput(token_id=tid, logprob=float(lps[j][0]), top_logprobs=top, mask_ids=mids,
                                  mask_logprobs=[float(x) for x in mlp] if mlp is not None else None,
                                  weight_version=str(vers[j])))
    fr = meta.get("finish_reason") or {"type": "length", "length": len(ids)}
    return RequestResult(rid=str(meta.get("id", "")), output_ids=ids, tokens=tokens, finish_reason=dict(fr),
                         prompt_tokens=int(meta.get("prompt_tokens", 0)),
                         cached_tokens=int(meta.get("cached_tokens", 0)),
                         weight_version=str(meta.get("weight_version", "0")),
                         e2e_latency=float(meta.get("e2e_latency", 0.0)),
                         routed_experts=None if routed_shape is None else routed_experts(
                             resp, num_layers=routed_shape[0], top_k=routed_shape[1]))


class Orchestrator:
    """One real run of a plan. `await Orchestrator(plan, config).run()`; see the module doc."""

    def __init__(self, plan: Plan, config: RunConfig, *,
                 on_update: Callable[[UpdateView, Orchestrator], Any] | None = None,
                 on_event: Callable[[EventRecord], Any] | None = None) -> None:
        self.plan, self.config = plan, config
        # MoE: (layers, top_k) of the served checkpoint; samplers then record and return each token's experts
        self.routed_shape = _routed_shape(config.init_checkpoint)
        emb = plan.embedded or EmbeddedPlan()
        self.emb = emb
        self.on_update, self.on_event = on_update, on_event
        self.fleet: FleetSpec = fleet_from_plan(plan, mode=config.fleet_mode, attach=config.attach)
        policies = plan.build_policies()
        self.router, self.autoscaler, self.weight_sync = (policies["router"], policies["autoscaler"],
                                                          policies["weight_sync"])
        self.batcher = self._make_batcher(policies["batcher"])
        self.out = config.out_dir
        self.version = 0
        self.target = config.updates
        self.replicas: dict[str, list[Replica]] = {g.name: [] for g in self.fleet.groups}
        self.prompts: PromptBuffer[Sample] = PromptBuffer(self.batcher, _min_version)
        self.sessions: dict[str, Session] = {}
        self._sid = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()
        self._loop_start_s = math.nan                 # run clock when the first prompts started
        self._busy_at_loop_start_s = 0.0
        self._last_update_end_s = 0.0
        trainer_price = load_catalog(plan.price_table or None).with_prices(plan.prices).accelerator(
            plan.trainer.accelerator).price_usd_per_gpu_hour
        self.ledger = Ledger(self.fleet.group_names, trainer_usd_per_hour(trainer_price, plan.trainer.gpus))
        self._replica_s = {g.name: ReplicaSeconds(0.0) for g in self.fleet.groups}
        self._busy_gone_s = {g.name: 0.0 for g in self.fleet.groups}   # busy seconds of replicas no longer listed
        self.tokens_generated: dict[str, int] = {g.name: 0 for g in self.fleet.groups}
        self.restarts = 0                             # turns re-run on another replica after a replica loss
        self.trained_restarted = 0                    # trained trajectories that were re-routed at least once
        self.fresh_kl: dict[str, list[float]] = {}    # group -> [k3 * tokens, k1 * tokens, tokens], staleness 0
        self.trainer_busy_s = 0.0
        self.last_pass_at_k = math.nan
        self.writer: RunLogWriter | None = None
        self.trainer: Any = None
        self._stopping = False
        self._next_index: dict[str, int] = {g.name: 0 for g in self.fleet.groups}
        self._last_scale_check = -math.inf
        self._starting: dict[str, int] = {g.name: 0 for g in self.fleet.groups}
        self.weights_path: str = config.init_checkpoint
        self.weights_version = 0                      # the version weights_path holds
        self._pinned_paths: dict[str, int] = {}       # weight folders replicas are starting from (not deleted)
        self._probe_http: httpx.AsyncClient | None = None
        trainer_top_p = plan.trainer.top_p
        self.top_p_replay = bool(plan.trainer.top_p_replay and trainer_top_p < 1.0)
        self.sampling = SamplingParams(max_new_tokens=config.max_new_tokens or emb.max_new_tokens,
                                       temperature=config.temperature or emb.temperature, top_p=trainer_top_p)
        self.agent_config = AgentConfig(sampling=self.sampling, max_turns=config.max_turns or emb.max_turns,
                                        context_length=1024)
        self.task = config.task or emb.task or "guess"
        self.correction = {"method": plan.trainer.loss, "temperature": float(self.sampling.temperature),
                           "top_p_replay": self.top_p_replay}
        self.eval_every = config.eval_every if config.eval_every is not None else emb.eval_every
        self.pass_k = config.pass_k or emb.pass_k

    # ---- setup ---------------------------------------------------------------------------------------
    def _make_batcher(self, batcher: Any) -> Any:
        from mixfleet.policies.registry import make

        settings = {f: getattr(batcher.config, f) for f in batcher.config.__dataclass_fields__}
        settings.update(self.config.batcher_overrides)
        if self.config.mode == "sync":
            settings.update(max_staleness=0, stale="wait")
        return make("batcher", batcher.name, settings)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def event(self, kind: str, group: str = "", replica: int = -1, version: int = -1, detail: str = "",
              duration_s: float = math.nan) -> None:
        rec = EventRecord(time_s=self.now(), kind=kind, group=group, replica=replica, version=version,
                          detail=detail, duration_s=duration_s)
        if self.writer is not None:
            self.writer.append(rec)
        if self.on_event is not None:
            self.on_event(rec)

    def _header(self) -> dict[str, Any]:
        return {"source": "runner", "plan": self.plan.to_dict(), "seed": self.config.seed,
                "runner": {"mode": self.config.mode, "fleet_mode": self.fleet.mode, "task": self.task,
                           "updates": self.target, "init_checkpoint": self.config.init_checkpoint,
                           "groups": {g.name: {"replicas": g.replicas, "planned_replicas": g.planned_replicas,
                                               "precision": g.precision, "kv_dtype": g.kv_dtype,
                                               "kernel": g.kernel} for g in self.fleet.groups}}}

    async def _start(self) -> None:
        from mixfleet.runner.orchestration.actors import init_ray, remote_trainer

        self.out.mkdir(parents=True, exist_ok=True)
        state_dir = self.out / STATE_DIR
        resuming = self.config.resume and (state_dir / "trainer_meta.json").exists()
        if self.config.resume and not resuming and (self.out / "run.json").exists():
            # killed before the first checkpoint: nothing trained is kept; start over in a fresh log
            for name in ("run.json", "trajectories", "updates", "groups", "events"):
                p = self.out / name
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        self.writer = RunLogWriter(self.out, self._header(), flush_every_s=5.0, flush_every_rows=None)
        resources = dict(self.fleet.resources)
        if self.config.address is None:
            init_ray(num_cpus=self.config.ray_num_cpus, resources=resources)
        else:
            init_ray(address=self.config.address)
        import ray

        trainer_cls = remote_trainer()
        self.trainer = trainer_cls.remote(
            init_from=self.config.init_checkpoint, state_dir=str(state_dir), correction=self.correction,
            optimizer={"lr": self.config.lr, "grad_clip_norm": self.config.grad_clip_norm},
            threads=self.config.trainer_threads, resume=resuming, routing=self.plan.trainer.routing)

        def starts() -> list[Any]:
            return [self._start_replica(g, cold=False) for g in self.fleet.groups for _ in range(g.replicas)]

        if not resuming:                  # samplers load the base policy: start them while the trainer builds
            self.version, *_ = await asyncio.gather(self.trainer.version.remote(), *starts())
        else:
            self.version = await self.trainer.version.remote()
            dropped = self.writer.truncate_after_version(self.version, tables=("updates", "groups", "trajectories"))
            st = json.loads((state_dir / ORCH_STATE_FILE).read_text()) if (state_dir / ORCH_STATE_FILE).exists() else {}
            self.prompts.restore(st)
            self.restarts = int(st.get("restarts", 0))
            self.trainer_busy_s = float(st.get("trainer_busy_s", 0.0))
            self.fresh_kl = {g: [float(x) for x in a] for g, a in st.get("fresh_kl", {}).items()}
            self.trained_restarted = int(st.get("trained_restarted", 0))
            self._t0 = time.monotonic() - float(st.get("elapsed_s", 0.0))
            self._last_update_end_s = float(st.get("elapsed_s", 0.0))
            self.ledger.restore(st, self._last_update_end_s)
            self._replica_s = {g.name: ReplicaSeconds(self.now()) for g in self.fleet.groups}
            self.event("resume", version=self.version, detail=json.dumps({"dropped_rows": dropped}))
            if self.version > 0:
                self.weights_path, self.weights_version = await self._export(self.version), self.version
            await asyncio.gather(*starts())
        _ = ray

    async def _start_replica(self, g: GroupSpec, *, cold: bool, url: str | None = None) -> Replica | None:
        """Start (or attach) one replica of group `g`; logs cold_start / ready."""
        from mixfleet.runner.orchestration.actors import remote_sampler

        index = self._next_index[g.name]
        self._next_index[g.name] += 1
        self._starting[g.name] += 1
        self._recount(g.name)
        t0 = self.now()
        actor = None
        path, version = self.weights_path, self.weights_version
        self._pinned_paths[path] = self._pinned_paths.get(path, 0) + 1
        try:
            if self.fleet.mode == "attach":
                url = g.urls[index % len(g.urls)]
            else:
                cls = remote_sampler(accelerator=g.accelerator, amount=g.tp)
                actor = cls.remote(group=g.name, index=index, model_path=path, precision=g.precision,
                                   kv_dtype=g.kv_dtype, kernel=g.kernel, weight_noise=g.weight_noise,
                                   threads=self.config.sampler_threads or self.fleet.threads_per_replica,
                                   seed=self.config.seed * 1009 + zlib.crc32(f"{g.name}/{index}".encode()) % 1000,
                                   weight_version=str(version),
                                   mode="sglang" if self.fleet.mode == "sglang" else "embedded",
                                   top_p_replay=self.top_p_replay, tp=g.tp, dp_attention=g.dp_attention, ep=g.ep,
                                   routed_experts=self.routed_shape is not None)
                info = await actor.info.remote()
                url = info["url"]
        except Exception as e:  # noqa: BLE001 - a replica that cannot start is logged; the run goes on
            self.event("crash", g.name, index, self.version, detail=f"start failed: {type(e).__name__}: {e}")
            return None
        finally:
            self._starting[g.name] -= 1
            self._pinned_paths[path] -= 1
            self._recount(g.name)
        client = SamplerClient(url, config=ClientConfig(max_retries=2, backoff_initial_s=0.05, connect_timeout_s=5.0))
        served = 0 if self.fleet.mode == "attach" else version   # an attached server serves what it was started on
        rep = Replica(group=g.name, index=index, url=url, client=client, actor=actor, version=served,
                      started_s=self.now())
        if self.weights_version > served:             # a push landed while it started (or attached): catch up
            await self._load_weights(rep, self.weights_path, self.weights_version)
        self.replicas[g.name].append(rep)
        self._recount(g.name)
        if cold:
            self.event("cold_start", g.name, index, self.version, duration_s=self.now() - t0)
        self.event("ready", g.name, index, self.version, detail=url, duration_s=self.now() - t0)
        self._wake.set()
        return rep

    def _recount(self, group: str) -> None:
        """The group's replicas up / billed (up or starting) changed: integrate the old levels to now."""
        up = sum(1 for r in self.replicas[group] if r.up)
        self._replica_s[group].set(self.now(), up, up + self._starting[group])

    def _group_totals(self, g: GroupSpec, now: float) -> GroupTotals:
        rs = self._replica_s[g.name]
        rs.advance(now)
        return GroupTotals(up_replica_s=rs.up_s, cost_usd=g.usd_per_hour * rs.billed_s / 3600.0,
                           busy_s=self._busy_gone_s[g.name] + sum(r.busy_until(now) for r in self.replicas[g.name]),
                           tokens_generated=self.tokens_generated.get(g.name, 0))

    # ---- views for the policies ------------------------------------------------------------------------
    def group_view(self, g: GroupSpec) -> GroupView:
        now = self.now()
        reps = tuple(ReplicaView(index=r.index, up=r.up and r.admitting.is_set(),
                                 outstanding_tokens=r.outstanding_tokens, running=r.running,
                                 sessions=self.router.pinned(g.name, r.index),
                                 busy_s=r.busy_until(now)) for r in self.replicas[g.name])
        starting = tuple(ReplicaView(index=-1 - i, up=False, starting=True) for i in range(self._starting[g.name]))
        live_versions = [r.version for r in self.replicas[g.name] if r.up]
        return GroupView(name=g.name, capacity_tokens_per_s=g.capacity_tokens_per_s, usd_per_hour=g.usd_per_hour,
                         usd_per_mtoken=g.usd_per_mtoken, replicas=reps + starting, min_replicas=g.min_replicas,
                         max_replicas=g.max_replicas, configured_replicas=g.replicas,
                         weight_version=min(live_versions) if live_versions else self.version)

    def fleet_view(self) -> FleetView:
        return FleetView(now_s=self.now(), groups=tuple(self.group_view(g) for g in self.fleet.groups))

    # ---- sessions --------------------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _feeder(self) -> None:
        """Keep as many prompt-groups generating as the batcher admits (samplers never wait for the trainer)."""
        spp = self.prompts.samples_per_prompt
        while not self._stopping:
            for p in self.prompts.admit(self.version):
                for i in range(spp):
                    self._spawn(self._session(p, i))
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)

    async def _session(self, p: PromptGroup[Sample], sample_index: int) -> None:
        sid = next(self._sid)
        seed = self.config.seed * 1_000_003 + p.prompt_id
        s = Session(sid=sid, prompt_id=p.prompt_id, sample_index=sample_index,
                    session_id=f"p{p.prompt_id}-s{sample_index}-{uuid.uuid4().hex[:8]}")
        self.sessions[s.session_id] = s
        cfg = self.agent_config
        if cfg.sampling.sampling_seed is None:
            cfg = replace(cfg, sampling=replace(cfg.sampling, sampling_seed=(seed * 131 + sample_index) % (2**31)))
        try:
            ep = await run_episode(make_task(self.task, **self.config.task_options), seed, self._generate,
                                   config=cfg, session_id=s.session_id, clock=self.now)
        finally:
            self.router.release(sid)
            self.sessions.pop(s.session_id, None)
        for g, n in _tokens_by_group(ep).items():
            self.tokens_generated[g] = self.tokens_generated.get(g, 0) + n
        if ep.finish_reason == "error" and not ep.num_generated:
            self.prompts.abort(p, self.now())
        else:
            self.prompts.finish(p, (s, ep), self.now())
        self._wake.set()

    async def _generate(self, input_ids: list[int], params: SamplingParams, session_id: str) -> RequestResult:
        """One reply of a session: routed (sticky) by the plan's router; re-routed when its replica is lost."""
        s = self.sessions[session_id]
        body = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
                "top_k": params.top_k, "stop_token_ids": list(params.stop_token_ids)}
        if params.sampling_seed is not None:
            body["sampling_seed"] = int(params.sampling_seed) + 7919 * s.restarts
        while True:
            route = self.router.route(s.sid, self.fleet_view())
            if route is None:                     # nothing up (all crashed / draining): wait for the monitor
                await asyncio.sleep(0.2)
                continue
            rep = next((r for r in self.replicas[route[0]] if r.index == route[1]), None)
            if rep is None or not rep.up:
                await asyncio.sleep(0.05)
                continue
            if not rep.admitting.is_set():
                await rep.admitting.wait()
                continue
            rep.begin(self.now(), params.max_new_tokens)
            try:
                resp = await rep.client.generate_ids(
                    input_ids, body, top_logprobs_num=self.config.top_k_record, return_logprob=True,
                    return_sampling_mask=self.top_p_replay,
                    sampling_logprobs_mode="support" if self.top_p_replay else None, routing_key=session_id,
                    return_routed_experts=self.routed_shape is not None)
            except (SamplerUnavailable, httpx.HTTPError, SamplerHTTPError) as e:
                rep.end(self.now(), params.max_new_tokens)
                if isinstance(e, SamplerHTTPError) and e.status < 500:
                    raise                              # a request the sampler refuses: this episode's error
                if await self._probe(rep) is not False and rep.up and s.retries < MAX_SAME_REPLICA_RETRIES:
                    s.retries += 1                     # a dropped connection to a live replica: resend there
                    continue
                self._replica_lost(rep, f"{type(e).__name__}: {e}")
                s.restarts += 1
                self.restarts += 1
                continue
            rep.end(self.now(), params.max_new_tokens)
            s.replica, s.group = rep.index, rep.group
            result = result_from_response(resp, routed_shape=self.routed_shape)
            return _Served(result, rep.group)

    async def _probe(self, rep: Replica) -> bool | None:
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

    def _replica_lost(self, rep: Replica, reason: str) -> None:
        if not rep.up:
            return
        rep.up = False
        self._recount(rep.group)
        self.event("crash", rep.group, rep.index, rep.version, detail=reason[:300])
        self._spawn(rep.client.aclose())
        if rep.actor is not None:                      # make sure a hung one does not linger
            import ray

            with contextlib.suppress(Exception):
                ray.kill(rep.actor, no_restart=True)
        self._wake.set()

    def kill_replica(self, group: str, index: int | None = None) -> int:
        """Kill one sampler replica's process (fault injection; tests and the CLI's --kill-at). Returns its index."""
        import ray

        reps = [r for r in self.replicas[group] if r.up and (index is None or r.index == index)]
        if not reps:
            raise ValueError(f"kill_replica: no live replica {index} in group {group!r}")
        rep = reps[0]
        if rep.actor is not None:
            ray.kill(rep.actor, no_restart=True)
        return rep.index

    # ---- fleet monitor: autoscaler + replacement of lost replicas ---------------------------------------
    async def _monitor(self) -> None:
        interval = min(max(float(getattr(self.autoscaler.config, "interval_s", 5.0)), MONITOR_INTERVAL_S), 5.0)
        while not self._stopping:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            now = self.now()
            for g in self.fleet.groups:
                # probe replicas that look idle-but-up so a dead idle replica is noticed
                for rep in list(self.replicas[g.name]):
                    if rep.up and rep.actor is not None and rep.running == 0:
                        ok = await self._probe(rep)
                        rep.failed_probes = 0 if ok else rep.failed_probes + 1
                        if ok is False or rep.failed_probes >= MAX_FAILED_PROBES:
                            self._replica_lost(rep, f"health check failed ({rep.failed_probes} probes)")
                dead = [r for r in self.replicas[g.name] if not r.up]
                for r in dead:
                    self._busy_gone_s[g.name] += r.busy_until(now)
                    self.replicas[g.name].remove(r)
            if now - self._last_scale_check < interval:
                continue
            self._last_scale_check = now
            for g in self.fleet.groups:
                view = self.group_view(g)
                want = self.autoscaler.target(view, now)
                live = view.live_replicas
                lost = g.replicas - live
                if want > live:
                    for _ in range(want - live):
                        kind = "restart" if lost > 0 else "scale_up"
                        lost -= 1
                        self.event(kind, g.name, self._next_index[g.name], self.version)
                        self._spawn(self._start_replica(g, cold=True))
                elif want < live:
                    for rep in sorted(self.replicas[g.name], key=lambda r: (r.running, -r.index))[: live - want]:
                        self._spawn(self._retire(rep))

    async def _retire(self, rep: Replica) -> None:
        rep.admitting.clear()
        self.event("scale_down", rep.group, rep.index, rep.version)
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

    # ---- the trainer's side ----------------------------------------------------------------------------
    async def next_batch(self) -> list[PromptGroup[Sample]]:
        """Wait until the batcher forms an update from the completed prompt-groups; log the dropped ones."""
        while True:
            batch, dropped = self.prompts.decide(self.now(), self.version)
            for p in dropped:
                for s, ep in p.samples:
                    self._write_trajectory(s, ep, trained_version=-1)
            if batch is not None:
                return batch
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)

    async def train(self, prompts: list[PromptGroup[Sample]]) -> tuple[Any, dict[str, Any], float]:
        items = [BatchItem(episode=ep, prompt_id=p.prompt_id, sample_index=s.sample_index)
                 for p in prompts for s, ep in p.samples]
        batch = build_batch(items, trained_version=self.version + 1, group_names=self.fleet.group_names,
                            options=BatchOptions(top_k=self.config.top_k_record, top_p_replay=self.top_p_replay))
        t0 = self.now()
        metrics = await self.trainer.train.remote(batch.tensors)
        dt = self.now() - t0
        self.trainer_busy_s += dt
        return batch, metrics, dt

    async def _export(self, version: int) -> str:
        path = self.out / WEIGHTS_DIR / f"v{version:06d}"
        await self.trainer.export.remote(str(path), version)
        olds = sorted((self.out / WEIGHTS_DIR).glob("v*"))
        for old in olds[:-KEEP_WEIGHT_VERSIONS]:
            if not self._pinned_paths.get(str(old)):
                shutil.rmtree(old, ignore_errors=True)
        return str(path)

    async def _load_weights(self, rep: Replica, path: str, version: int) -> bool:
        t0 = self.now()
        try:
            res = await rep.client.update_weights_from_disk(path, weight_version=str(version))
        except (SamplerUnavailable, httpx.HTTPError, SamplerHTTPError) as e:
            res = {"success": False, "message": f"{type(e).__name__}: {e}"}
        ok = bool(res.get("success"))
        if ok:
            rep.version = version
        else:
            self.event("weight_push_failed", rep.group, rep.index, version,
                       detail=f"serving version {rep.version}: {str(res.get('message', ''))[:300]}",
                       duration_s=self.now() - t0)
        return ok

    def _broken_copy(self, path: str, version: int, group: str) -> str:
        """Fault injection: a copy of the checkpoint whose weights file is truncated (a real failed load)."""
        dst = self.out / WEIGHTS_DIR / f".broken-v{version:06d}-{group}"
        shutil.copytree(path, dst, dirs_exist_ok=True)
        for f in dst.glob("*.safetensors"):
            f.write_bytes(f.read_bytes()[:64])
        return str(dst)

    async def push_weights(self, version: int) -> float:
        """Export version `version` and push it to every group the weight-sync policy picks (concurrently)."""
        t0 = self.now()
        path = await self._export(version)
        self.weights_path, self.weights_version = path, version

        async def push_group(g: GroupSpec) -> None:
            decision = self.weight_sync.decide(self.group_view(g), version, self.now())
            if not decision.push:
                return
            reps = [r for r in self.replicas[g.name] if r.up]
            src = path
            if version in self.config.inject_weight_load_failure.get(g.name, []):
                src = self._broken_copy(path, version, g.name)
            t1 = self.now()
            if decision.drain:
                for r in reps:
                    r.admitting.clear()
                while any(r.running for r in reps):
                    await asyncio.sleep(0.02)
            oks = await asyncio.gather(*[self._load_weights(r, src, version) for r in reps])
            for r in reps:
                r.admitting.set()
            self.event("weight_push", g.name, version=version, duration_s=self.now() - t1,
                       detail=weight_push_detail("drain" if decision.drain else "in_flight", len(reps), sum(oks)))

        await asyncio.gather(*[push_group(g) for g in self.fleet.groups])
        return self.now() - t0

    # ---- evaluation ------------------------------------------------------------------------------------
    async def evaluate(self, version: int) -> float:
        from mixfleet.runner.rollout.evaluation import EvalConfig, pass_at_k_eval

        cfg = EvalConfig(task=self.task, task_options=self.config.task_options, problems=self.config.eval_problems,
                         k=self.pass_k, max_turns=self.agent_config.max_turns,
                         max_new_tokens=self.sampling.max_new_tokens, temperature=self.sampling.temperature,
                         seed=self.config.seed)
        res = await pass_at_k_eval(self.weights_path, cfg)
        self.event("note", version=version, detail=json.dumps({"eval": "pass_at_k", "k": cfg.k, "version": version,
                                                               "pass_at_k": res.pass_at_k, "reward": res.reward_mean,
                                                               "problems": cfg.problems}), duration_s=res.wall_s)
        return res.pass_at_k

    # ---- run log ---------------------------------------------------------------------------------------
    def _write_trajectory(self, s: Session, ep: Episode, trained_version: int) -> None:
        if self.writer is None:
            return
        first, last = ep.weight_version_span()
        v0, v1 = max(version_int(first), 0), max(version_int(last), 0)
        tbv = {version_int(k): v for k, v in ep.tokens_by_version().items()}
        reason = ep.finish_reason
        self.writer.append(TrajectoryRecord(
            run_id=self.writer.run_id, prompt_id=str(s.prompt_id), sample_index=s.sample_index,
            group=ep.group_id or s.group, replica=max(s.replica, 0), version_start=v0, version_end=max(v1, v0),
            turns=ep.num_turns, prompt_tokens=len(ep.tokens) - ep.num_generated, generated_tokens=ep.num_generated,
            start_s=max(ep.start_s, 0.0), end_s=max(ep.end_s, ep.start_s, 0.0), reward=ep.reward,
            finish_reason=reason, restarts=s.restarts, tokens_by_version=tbv, trained_version=trained_version))

    def log_update(self, prompts: list[PromptGroup[Sample]], batch: Any, metrics: Mapping[str, Any], start_s: float,
                   train_s: float, sync_s: float, pass_at_k: float) -> UpdateView:
        assert self.writer is not None
        v = batch.trained_version
        now = self.now()
        for p in prompts:
            for s, ep in p.samples:
                self._write_trajectory(s, ep, trained_version=v)
                self.trained_restarted += s.restarts > 0
        by_group, fresh = group_metrics(metrics, batch.group_names)
        for g, m in fresh.items():
            acc = self.fresh_kl.setdefault(g, [0.0, 0.0, 0.0])
            acc[0] += m.get("k3", 0.0) * m.get("tokens", 0.0)
            acc[1] += m.get("k1", 0.0) * m.get("tokens", 0.0)
            acc[2] += m.get("tokens", 0.0)
        nan = math.nan
        batches = {}
        for g in self.fleet.groups:
            gm, fm = by_group.get(g.name, {}), fresh.get(g.name, {})
            batches[g.name] = GroupBatch(
                samples=batch.samples_by_group.get(g.name, 0), tokens_trained=batch.tokens_by_group.get(g.name, 0),
                staleness_mean=batch.staleness_by_group.get(g.name, nan), kl_k3=gm.get("k3", nan),
                kl_k1=gm.get("k1", nan), masked_share=gm.get("out_band_share", nan),
                extreme_share=gm.get("out_diag_low_share", nan) + gm.get("out_diag_high_share", nan),
                kl_k3_on_policy=fm.get("k3", nan), kl_k1_on_policy=fm.get("k1", nan),
                tokens_on_policy=int(fm.get("tokens", 0)), routing_token_share=gm.get("routing_token_share", nan),
                routing_layer_share=gm.get("routing_layer_share", nan))
        st = batch.staleness_stats()
        reward = sum(batch.rewards) / max(len(batch.rewards), 1)
        low, high = metrics.get("out_diag_low_share", nan), metrics.get("out_diag_high_share", nan)
        totals = {g.name: self._group_totals(g, now) for g in self.fleet.groups}
        update, rows = self.ledger.record(
            version=v, now_s=now, start_s=start_s, totals=totals, batches=batches, train_step_s=train_s,
            weight_sync_s=sync_s, tokens=batch.num_tokens, trajectories=batch.num_trajectories, staleness=st,
            kl_k1=metrics.get("k1", nan), kl_k3=metrics.get("k3", nan), masked_share=metrics.get("out_band_share", nan),
            extreme_share=low + high, extreme_low_share=low, extreme_high_share=high, ess=metrics.get("ess", nan),
            entropy=metrics.get("entropy", nan), grad_norm=metrics.get("grad_norm", nan), loss=metrics.get("loss", nan),
            reward_mean=reward, pass_at_k=pass_at_k)
        self.writer.extend(rows)
        self.writer.append(update)
        self.writer.flush()
        gen_total = sum(self.tokens_generated.values())
        self._last_update_end_s = now
        return UpdateView(version=v, target=self.target, elapsed_s=now, reward_mean=reward,
                          kl_k3=float(metrics.get("k3", math.nan)),
                          kl_by_group={g: m.get("k3", math.nan) for g, m in by_group.items()},
                          kl_on_policy_by_group={g: m.get("k3", math.nan) for g, m in fresh.items()},
                          staleness_mean=st["staleness_mean"], staleness_max=st["staleness_max"],
                          tokens_per_s=gen_total / max(now, 1e-9), pass_at_k=pass_at_k, restarts=self.restarts,
                          replicas_up={g: sum(1 for r in reps if r.up) for g, reps in self.replicas.items()},
                          trainer_idle_share=1.0 - self.trainer_busy_s / max(now, 1e-9))

    async def _checkpoint(self) -> None:
        state_dir = self.out / STATE_DIR
        await self.trainer.save_state.remote(str(state_dir))
        tmp = state_dir / f".{ORCH_STATE_FILE}.tmp"
        tmp.write_text(json.dumps({"version": self.version, **self.prompts.state(),
                                   "restarts": self.restarts, "trainer_busy_s": self.trainer_busy_s,
                                   **self.ledger.state({g.name: self._group_totals(g, self.now())
                                                        for g in self.fleet.groups}), "elapsed_s": self.now(),
                                   "fresh_kl": self.fresh_kl, "trained_restarted": self.trained_restarted}))
        os.replace(tmp, state_dir / ORCH_STATE_FILE)

    # ---- the loop --------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Run until the trainer reaches `config.updates`; returns a summary dict."""
        status = "failed"
        try:
            await self._start()
            self._spawn(self._monitor())
            if self.eval_every and self.config.eval_at_start and self.version == 0:
                self.last_pass_at_k = await self.evaluate(0)
            self._loop_start_s, self._busy_at_loop_start_s = self.now(), self.trainer_busy_s
            self._spawn(self._feeder())
            while self.version < self.target:
                prompts = await self.next_batch()                      # generate (continuously) -> batch
                start_s = self.now()
                batch, metrics, train_s = await self.train(prompts)    # train (samplers keep sampling)
                sync_s = await self.push_weights(batch.trained_version)  # push weights to every group
                self.version = batch.trained_version
                self._wake.set()
                pak = math.nan
                if self.eval_every and self.version % self.eval_every == 0:
                    pak = self.last_pass_at_k = await self.evaluate(self.version)
                view = self.log_update(prompts, batch, metrics, start_s, train_s, sync_s, pak)
                await self._checkpoint()
                if self.on_update is not None:
                    r = self.on_update(view, self)
                    if asyncio.iscoroutine(r):
                        await r
            status = "finished"
        finally:
            await self._stop(status)
        return {"version": self.version, "elapsed_s": self.now(), "restarts": self.restarts,
                "on_policy_kl_by_group": self.on_policy_kl(),
                "trainer_idle_share": 1.0 - self.trainer_busy_s / max(self.now(), 1e-9), "out": str(self.out),
                **self.loop_stats()}

    def on_policy_kl(self) -> dict[str, dict[str, float]]:
        """Per group, k3 / k1 over its staleness-0 trained tokens of the whole run (the precision mismatch alone)."""
        return {g: {"k3": a[0] / a[2], "k1": a[1] / a[2], "tokens": a[2]} for g, a in self.fresh_kl.items() if a[2] > 0}

    def loop_stats(self) -> dict[str, float]:
        """Seconds of the update loop (first prompts started -> last update logged) and the trainer's idle
        share over it (what the async-vs-sync benchmark compares; start-up is excluded)."""
        loop_s = self._last_update_end_s - self._loop_start_s
        busy = self.trainer_busy_s - self._busy_at_loop_start_s
        return {"loop_s": loop_s, "loop_trainer_busy_s": busy,
                "loop_trainer_idle_share": 1.0 - busy / loop_s if loop_s > 0 else math.nan}

    async def _cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the driver, the trainer and the live samplers (what the run cost the
        machine, independent of other load on it)."""
        t = os.times()
        out = {"driver": t.user + t.system}
        with contextlib.suppress(Exception):
            out["trainer"] = float(await asyncio.wait_for(self.trainer.cpu_s.remote(), 10))
        for g, reps in self.replicas.items():
            for r in reps:
                if r.up and r.actor is not None:
                    with contextlib.suppress(Exception):
                        out[f"{g}#{r.index}"] = float(await asyncio.wait_for(r.actor.cpu_s.remote(), 10))
        return out

    async def _stop(self, status: str) -> None:
        self._stopping = True
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        cpu = await self._cpu_seconds() if self.trainer is not None else {}
        import ray

        for reps in self.replicas.values():
            for r in reps:
                with contextlib.suppress(Exception):
                    await r.client.aclose()
                if r.actor is not None:
                    with contextlib.suppress(Exception):
                        ray.kill(r.actor, no_restart=True)
        if self.trainer is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.trainer, no_restart=True)
        if self._probe_http is not None:
            await self._probe_http.aclose()
        if self.writer is not None:
            self.writer.update_header(wall_s=self.now(), trainer_busy_s=self.trainer_busy_s,
                                      trainer_idle_share=1.0 - self.trainer_busy_s / max(self.now(), 1e-9),
                                      on_policy_kl_by_group=self.on_policy_kl(), cpu_s=cpu,
                                      cpu_s_total=sum(cpu.values()), **self.loop_stats())
            self.writer.close(status)
            self.writer = None


class _Served:
    """A RequestResult plus the group that served it (the agent loop reads `group_id`)."""

    def __init__(self, result: RequestResult, group_id: str) -> None:
        self._r, self.group_id = result, group_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._r, name)


def _tokens_by_group(ep: Episode) -> dict[str, int]:
    out: dict[str, int] = {}
    for g, m in zip(ep.group_ids, ep.loss_mask, strict=True):
        if m and g is not None:
            out[g] = out.get(g, 0) + 1
    return out


def run_plan(plan: Plan, config: RunConfig, *, on_update: Callable[[UpdateView, Orchestrator], Any] | None = None,
             on_event: Callable[[EventRecord], Any] | None = None, shutdown_ray: bool = True) -> dict[str, Any]:
    """Blocking entry point: run `plan` per `config`; shuts the local Ray down afterwards."""
    orch = Orchestrator(plan, config, on_update=on_update, on_event=on_event)
    try:
        return asyncio.run(orch.run())
    finally:
        if shutdown_ray:
            import ray

            if ray.is_initialized():
                ray.shutdown()
