"""The real runner's update loop: fully asynchronous RL over a mixed sampler fleet, with the plan's policies.

    while version < target:
        batch = await next_batch()        # batcher: oldest complete prompt-groups (sessions keep running)
        metrics = await train(batch)      # trainer actor: one optimizer step (samplers keep sampling)
        await publish(version)            # weight-sync policy per group; each group re-quantizes
        log_update(batch, metrics)        # run log: updates, groups, trajectories; then checkpoint

Around it, concurrently (each its own part of runner/orchestration/): the rollouts (rollouts.py: a prompt
feeder, the batcher's `admit` deciding how many prompt-groups run at once, and one task per episode whose
every reply the plan's router sends to a replica), the fleet monitor (sampler_fleet.py: the autoscaler's
target per group, crashed replicas replaced), weight publishing (weights.py) and the run log (recorder.py).

The policies are the very objects the twin uses (policies/), fed the same views (policies/views.py), and
the prompt-groups live in the same prompt buffer (policies/prompt_buffer.py). Synchronous mode (the
benchmark's baseline) is the same loop with the batcher set to `max_staleness = 0, stale = "wait"`:
prompts of update v+1 start only once version v is pushed.

Resume: the run log is cut back to the trainer checkpoint's version (`truncate_after_version`) and the loop
continues from it, so no update is duplicated or lost; the log records an update before the checkpoint
is saved. What was in flight when the run died is lost, and counted so (the prompt buffer's `restore`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
from collections.abc import Callable
from typing import Any

from mixfleet.costmodel.catalog import load_catalog
from mixfleet.costmodel.ledger import GroupTotals, trainer_usd_per_hour
from mixfleet.costmodel.runlog import EventRecord
from mixfleet.policies.plan import EmbeddedPlan, Plan
from mixfleet.policies.prompt_buffer import PromptBuffer, PromptGroup
from mixfleet.runner.orchestration.batching import BatchItem, BatchOptions, build_batch
from mixfleet.runner.orchestration.config import ORCH_STATE_FILE, STATE_DIR, RunConfig, RunContext, RunFailed
from mixfleet.runner.orchestration.fleet import fleet_from_plan
from mixfleet.runner.orchestration.placement import trainer_placement
from mixfleet.runner.orchestration.recorder import RunRecorder, UpdateView
from mixfleet.runner.orchestration.rollouts import (
    Rollouts,
    Sample,
    result_from_response,
    routed_shape,
    sample_min_version,
)
from mixfleet.runner.orchestration.sampler_fleet import Replica, SamplerFleet
from mixfleet.runner.orchestration.weights import WeightPublisher
from mixfleet.runner.rollout.agent import AgentConfig
from mixfleet.runner.sampler.engine_api import SamplingParams

__all__ = ["Orchestrator", "RunConfig", "RunFailed", "UpdateView", "result_from_response", "run_plan"]


class Orchestrator:
    """One real run of a plan. `await Orchestrator(plan, config).run()`; see the module doc."""

    def __init__(self, plan: Plan, config: RunConfig, *,
                 on_update: Callable[[UpdateView, Orchestrator], Any] | None = None,
                 on_event: Callable[[EventRecord], Any] | None = None) -> None:
        self.plan, self.config = plan, config
        # MoE: (layers, top_k) of the served checkpoint; samplers then record and return each token's experts
        self.routed_shape = routed_shape(config.init_checkpoint)
        emb = plan.embedded or EmbeddedPlan()
        self.on_update = on_update
        self.ctx = ctx = RunContext(config, on_event)
        self.out, self.target = config.out_dir, config.updates
        self.spec = fleet_from_plan(plan, mode=config.fleet_mode, attach=config.attach)
        policies = plan.build_policies()
        self.router = policies["router"]
        self.prompts: PromptBuffer[Sample] = PromptBuffer(self._make_batcher(policies["batcher"]), sample_min_version)
        self.stop_requested = False   # set (e.g. on SIGTERM): end after the current update, status 'stopped'
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
        # the parts
        self.weights = WeightPublisher(ctx, policies["weight_sync"], config.init_checkpoint,
                                       distributed=self.spec.mode != "attach")
        self.fleet = SamplerFleet(ctx, self.spec, router=self.router, autoscaler=policies["autoscaler"],
                                  weights=self.weights, top_p_replay=self.top_p_replay,
                                  routed_experts=self.routed_shape is not None)
        self.rollouts = Rollouts(ctx, self.prompts, self.fleet, router=self.router, agent_config=self.agent_config,
                                 task=self.task, top_p_replay=self.top_p_replay, routed_shape=self.routed_shape)
        price = load_catalog(plan.price_table or None).with_prices(plan.prices).accelerator(
            plan.trainer.accelerator).price_usd_per_gpu_hour
        self.recorder = RunRecorder(ctx, self.fleet.names, trainer_usd_per_hour(price, plan.trainer.gpus))
        self.trainer: Any = None
        self.trainer_busy_s = 0.0
        self.last_pass_at_k = math.nan
        self._loop_start_s = math.nan                 # run clock when the first prompts started
        self._busy_at_loop_start_s = 0.0

    def _make_batcher(self, batcher: Any) -> Any:
        from mixfleet.policies.registry import make

        settings = {f: getattr(batcher.config, f) for f in batcher.config.__dataclass_fields__}
        settings.update(self.config.batcher_overrides)
        if self.config.mode == "sync":
            settings.update(max_staleness=0, stale="wait")
        return make("batcher", batcher.name, settings)

    # ---- what callers (the live view, the CLI's fault drill, tests) read ----------------------------------
    @property
    def version(self) -> int:
        return self.ctx.version

    @property
    def replicas(self) -> dict[str, list[Replica]]:
        return self.fleet.replicas

    @property
    def restarts(self) -> int:
        return self.rollouts.restarts

    @property
    def trained_restarted(self) -> int:
        return self.recorder.trained_restarted

    def now(self) -> float:
        return self.ctx.now()

    def kill_replica(self, group: str, index: int | None = None) -> int:
        """Kill one sampler replica's process (the CLI's --kill-at fault drill). Returns its index."""
        return self.fleet.kill(group, index)

    def _totals(self) -> dict[str, GroupTotals]:
        now = self.now()
        return {g: self.fleet.totals(g, now, self.rollouts.tokens_generated.get(g, 0)) for g in self.fleet.names}

    # ---- start -----------------------------------------------------------------------------------------
    def _header(self) -> dict[str, Any]:
        return {"source": "runner", "plan": self.plan.to_dict(), "seed": self.config.seed,
                "runner": {"mode": self.config.mode, "fleet_mode": self.spec.mode, "task": self.task,
                           "updates": self.target, "init_checkpoint": self.config.init_checkpoint,
                           "groups": {g.name: {"replicas": g.replicas, "planned_replicas": g.planned_replicas,
                                               "precision": g.precision, "kv_dtype": g.kv_dtype,
                                               "kernel": g.kernel} for g in self.spec.groups}}}

    async def _start(self) -> None:
        from mixfleet.runner.orchestration.actors import init_ray, remote_trainer

        ctx, cfg = self.ctx, self.config
        self.out.mkdir(parents=True, exist_ok=True)
        state_dir = self.out / STATE_DIR
        resuming = cfg.resume and (state_dir / "trainer_meta.json").exists()
        if cfg.resume and not resuming and (self.out / "run.json").exists():
            # killed before the first checkpoint: nothing trained is kept; start over in a fresh log
            for name in ("run.json", "trajectories", "updates", "groups", "events"):
                p = self.out / name
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        writer = self.recorder.open(self._header())
        if cfg.address is None:
            init_ray(num_cpus=cfg.ray_num_cpus, resources=dict(self.spec.resources))
        else:
            init_ray(address=cfg.address)
        # on a cluster the trainer goes to a node carrying the plan's trainer accelerator (`{"H100": gpus}`)
        placement = trainer_placement(self.plan.name, self.plan.trainer.accelerator, self.plan.trainer.gpus) \
            if cfg.address else {}
        reserved = {placement["accelerator"]: float(placement["amount"])} if placement else {}
        self.trainer = remote_trainer(**placement).remote(
            init_from=cfg.init_checkpoint, state_dir=str(state_dir), correction=self.correction,
            optimizer={"lr": cfg.lr, "grad_clip_norm": cfg.grad_clip_norm},
            threads=cfg.trainer_threads, resume=resuming, routing=self.plan.trainer.routing)
        if not resuming:                  # samplers load the base policy: start them while the trainer builds
            await self.weights.begin()
            ctx.version, *_ = await asyncio.gather(self.trainer.version.remote(), *self.fleet.start_planned(reserved))
            return
        ctx.version = await self.trainer.version.remote()
        dropped = writer.truncate_after_version(ctx.version, tables=("updates", "groups", "trajectories"))
        st = json.loads((state_dir / ORCH_STATE_FILE).read_text()) if (state_dir / ORCH_STATE_FILE).exists() else {}
        self.prompts.restore(st)
        self.rollouts.restarts = int(st.get("restarts", 0))
        self.trainer_busy_s = float(st.get("trainer_busy_s", 0.0))
        ctx.continue_clock(float(st.get("elapsed_s", 0.0)))
        self.recorder.restore(st, float(st.get("elapsed_s", 0.0)))
        self.fleet.restart_clock()
        ctx.event("resume", version=ctx.version, detail=json.dumps(   # the ids this segment admits start there
            {"dropped_rows": dropped, "first_prompt_id": self.prompts.started}))
        await self.weights.begin(publish_base=ctx.version == 0)
        if ctx.version > 0:
            await self.weights.export(self.trainer, ctx.version)
        await asyncio.gather(*self.fleet.start_planned(reserved))

    # ---- the trainer's side ----------------------------------------------------------------------------
    async def next_batch(self) -> list[PromptGroup[Sample]]:
        """Wait until the batcher forms an update from the completed prompt-groups; log the dropped ones."""
        while True:
            if self.ctx.fatal is not None:
                raise self.ctx.fatal
            batch, dropped = self.prompts.decide(self.now(), self.version)
            for p in dropped:
                for s, ep in p.samples:
                    self.recorder.write_trajectory(s, ep, trained_version=-1)
            if batch is not None:
                return batch
            await self.ctx.wait_wake()

    async def train(self, prompts: list[PromptGroup[Sample]]) -> tuple[Any, dict[str, Any], float]:
        items = [BatchItem(episode=ep, prompt_id=p.prompt_id, sample_index=s.sample_index)
                 for p in prompts for s, ep in p.samples]
        batch = build_batch(items, trained_version=self.version + 1, group_names=self.spec.group_names,
                            options=BatchOptions(top_k=self.config.top_k_record, top_p_replay=self.top_p_replay))
        t0 = self.now()
        metrics = await self.trainer.train.remote(batch.tensors)
        dt = self.now() - t0
        self.trainer_busy_s += dt
        return batch, metrics, dt

    async def evaluate(self, version: int) -> float:
        from mixfleet.runner.rollout.evaluation import EvalConfig, pass_at_k_eval

        cfg = EvalConfig(task=self.task, task_options=self.config.task_options, problems=self.config.eval_problems,
                         k=self.pass_k, max_turns=self.agent_config.max_turns,
                         max_new_tokens=self.sampling.max_new_tokens, temperature=self.sampling.temperature,
                         seed=self.config.seed)
        res = await pass_at_k_eval(await self.weights.local_copy(), cfg)
        self.ctx.event("note", version=version, detail=json.dumps({
            "eval": "pass_at_k", "k": cfg.k, "version": version, "pass_at_k": res.pass_at_k,
            "reward": res.reward_mean, "problems": cfg.problems}), duration_s=res.wall_s)
        return res.pass_at_k

    async def _checkpoint(self) -> None:
        state_dir = self.out / STATE_DIR
        await self.trainer.save_state.remote(str(state_dir))
        tmp = state_dir / f".{ORCH_STATE_FILE}.tmp"
        tmp.write_text(json.dumps({"version": self.version, **self.prompts.state(), "restarts": self.restarts,
                                   "trainer_busy_s": self.trainer_busy_s, "elapsed_s": self.now(),
                                   **self.recorder.state(self._totals())}))
        os.replace(tmp, state_dir / ORCH_STATE_FILE)

    # ---- the loop --------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Run until the trainer reaches `config.updates`; returns a summary dict."""
        ctx = self.ctx
        status = "failed"
        try:
            await self._start()
            if ctx.fatal is not None:                                  # e.g. a planned group cannot start
                raise ctx.fatal
            ctx.spawn(self.fleet.monitor())
            if self.eval_every and self.config.eval_at_start and self.version == 0:
                self.last_pass_at_k = await self.evaluate(0)
            self._loop_start_s, self._busy_at_loop_start_s = self.now(), self.trainer_busy_s
            ctx.spawn(self.rollouts.feeder())
            while self.version < self.target and not self.stop_requested:
                prompts = await self.next_batch()                      # generate (continuously) -> batch
                start_s = self.now()
                batch, metrics, train_s = await self.train(prompts)    # train (samplers keep sampling)
                sync_s = await self.weights.publish(self.trainer, batch.trained_version, self.fleet)
                ctx.version = batch.trained_version
                ctx.wake.set()
                pak = math.nan
                if self.eval_every and self.version % self.eval_every == 0:
                    pak = self.last_pass_at_k = await self.evaluate(self.version)
                now = self.now()
                view = self.recorder.log_update(
                    prompts, batch, metrics, start_s=start_s, train_s=train_s, sync_s=sync_s, pass_at_k=pak,
                    totals=self._totals(), target=self.target, restarts=self.restarts,
                    tokens_per_s=sum(self.rollouts.tokens_generated.values()) / max(now, 1e-9),
                    replicas_up={g: sum(1 for r in reps if r.up) for g, reps in self.replicas.items()},
                    trainer_idle_share=1.0 - self.trainer_busy_s / max(now, 1e-9))
                await self._checkpoint()
                if self.on_update is not None:
                    r = self.on_update(view, self)
                    if asyncio.iscoroutine(r):
                        await r
            status = "stopped" if self.version < self.target else "finished"
        finally:
            await self._stop(status)
        return {"version": self.version, "elapsed_s": self.now(), "restarts": self.restarts,
                "on_policy_kl_by_group": self.recorder.on_policy_kl(),
                "trainer_idle_share": 1.0 - self.trainer_busy_s / max(self.now(), 1e-9), "out": str(self.out),
                "lost_groups": dict(self.fleet.lost_groups), **self.loop_stats()}

    def loop_stats(self) -> dict[str, float]:
        """Seconds of the update loop (first prompts started -> last update logged) and the trainer's idle
        share over it (what the async-vs-sync benchmark compares; start-up is excluded)."""
        loop_s = self.recorder.last_update_s - self._loop_start_s
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
        return {**out, **await self.fleet.cpu_seconds()}

    async def _stop(self, status: str) -> None:
        await self.ctx.cancel_tasks()
        cpu = await self._cpu_seconds() if self.trainer is not None else {}
        await self.fleet.close()
        await self.weights.close()
        if self.trainer is not None:
            import ray

            with contextlib.suppress(Exception):
                ray.kill(self.trainer, no_restart=True)
        self.recorder.close(status, wall_s=self.now(), trainer_busy_s=self.trainer_busy_s,
                            trainer_idle_share=1.0 - self.trainer_busy_s / max(self.now(), 1e-9),
                            on_policy_kl_by_group=self.recorder.on_policy_kl(), cpu_s=cpu,
                            lost_groups=dict(self.fleet.lost_groups),
                            cpu_s_total=sum(cpu.values()), **self.loop_stats())


def run_plan(plan: Plan, config: RunConfig, *, on_update: Callable[[UpdateView, Orchestrator], Any] | None = None,
             on_event: Callable[[EventRecord], Any] | None = None, shutdown_ray: bool = True,
             setup: Callable[[Orchestrator], Any] | None = None) -> dict[str, Any]:
    """Blocking entry point: run `plan` per `config`; shuts the local Ray down afterwards. `setup(orch)` is
    called before the run starts (tests install their fault hooks there, e.g. `orch.weights.source_for`)."""
    orch = Orchestrator(plan, config, on_update=on_update, on_event=on_event)
    if setup is not None:
        setup(orch)
    try:
        return asyncio.run(orch.run())
    finally:
        if shutdown_ray:
            import ray

            if ray.is_initialized():
                ray.shutdown()
