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
is saved. What was in flight when the run died is lost, and counted so (the prompt buffer's `restore`). What a
kill left in the run folder is checked and put right before anything starts by resume.py (`prepare_resume`); a
failed run's one-line messages are failures.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records import writepoints
from mixfleet.costmodel.records.ledger import GroupTotals, trainer_usd_per_hour
from mixfleet.costmodel.records.outdir import lock_output_dir
from mixfleet.costmodel.records.runlog import EventRecord
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.policies.plan import Plan
from mixfleet.policies.prompt_buffer import PromptBuffer, PromptGroup
from mixfleet.runner.checkpoint.hf_checkpoint import replace_dir_atomically
from mixfleet.runner.orchestration.batching import BatchItem, BatchOptions, build_batch
from mixfleet.runner.orchestration.config import (
    ORCH_STATE_FILE,
    STATE_DIR,
    RunConfig,
    RunContext,
    RunFailed,
    check_plan_task,
    run_settings,
    task_of,
)
from mixfleet.runner.orchestration.failures import actor_died, resume_hint, trainer_error, write_failure
from mixfleet.runner.orchestration.fleet import fleet_from_plan
from mixfleet.runner.orchestration.placement import trainer_placement
from mixfleet.runner.orchestration.recorder import RunRecorder, UpdateView
from mixfleet.runner.orchestration.resume import prepare_resume, staging_dir
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
        # the run settings are the plan's own (its [embedded] table, overrides already in it: recipe.py)
        self.plan, self.config = plan, config
        self.settings = settings = run_settings(plan)
        # MoE: (layers, top_k) of the served checkpoint; samplers then record and return each token's experts
        self.routed_shape = routed_shape(config.init_checkpoint)
        self.on_update = on_update
        self.ctx = ctx = RunContext(config, settings, on_event)
        self.out, self.target = config.out_dir, config.updates
        self.spec = fleet_from_plan(plan, mode=config.fleet_mode, attach=config.attach)
        policies = plan.build_policies()
        self.router = policies["router"]
        self.prompts: PromptBuffer[Sample] = PromptBuffer(self._make_batcher(policies["batcher"]), sample_min_version)
        self.stop_requested = False   # set (e.g. on SIGTERM): end after the current update, status 'stopped'
        trainer_top_p = plan.trainer.top_p
        self.top_p_replay = bool(plan.trainer.top_p_replay and trainer_top_p < 1.0)
        self.sampling = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                                       top_p=trainer_top_p)
        self.agent_config = AgentConfig(sampling=self.sampling, max_turns=settings.max_turns,
                                        context_length=1024)
        self.task = task_of(plan)
        self.correction = {"method": plan.trainer.loss, "temperature": float(self.sampling.temperature),
                           "top_p_replay": self.top_p_replay, "loss_agg": settings.loss_agg}
        self.eval_every, self.pass_k = settings.eval_every, settings.pass_k
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
        self._saved_version = 0                       # the version of the run folder's checkpoint (0: none)
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

        ctx, cfg, st = self.ctx, self.config, self.settings
        check_plan_task(self.plan)
        # one writer per run folder, for the whole run (released by _stop); then what a kill left is put right
        self._out_lock = lock_output_dir(self.out, where="mixfleet run")
        state_dir = self.out / STATE_DIR
        point = prepare_resume(self.out, self.plan, take_new_settings=cfg.take_new_settings) if cfg.resume else None
        if point is None and (state_dir.exists() or (self.out / "run.json").exists()):
            raise SpecError("mixfleet run", "--out", str(self.out), "a new or empty folder (it holds a run: "
                            "pass resume=True / --resume to continue it)")
        resuming = point is not None and point.from_state
        replan = getattr(self.fleet.autoscaler, "attach", None)   # the re-planner (policies.replan) reads the log
        header = self._header()
        if point is not None and not point.new_settings:
            header["plan"] = point.plan             # the same plan (checked): keep it as the log recorded it
        writer = self.recorder.open(header, taken=point.new_settings if point is not None else ())
        if replan is not None:   # it re-solves with the planner's solver, as in the twin (planner.solver)
            from mixfleet.planner.solver import solver_for

            replan(writer, solver_for(self.plan))
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
            optimizer={"lr": st.lr, "grad_clip_norm": st.grad_clip_norm, "warmup_steps": st.lr_warmup_steps},
            threads=st.trainer_threads, resume=resuming, routing=self.plan.trainer.routing)
        if writepoints.wants("trainer"):                # a test kills the trainer at a named write
            writepoints.victim("trainer", await self.trainer.pid.remote())
        if point is None:                 # samplers load the base policy: start them while the trainer builds
            await self.weights.begin()
            ctx.version, *_ = await asyncio.gather(_trainer_version(self.trainer, None),
                                                   *self.fleet.start_planned(reserved))
            return
        ctx.version = await _trainer_version(self.trainer, state_dir if resuming else None)
        if ctx.version != point.version:
            raise RunFailed(f"{state_dir}: the trainer loaded version {ctx.version}, its trainer_meta.json says "
                            f"{point.version}: not one checkpoint; nothing was changed in the run log")
        dropped = writer.truncate_after_version(ctx.version, tables=("updates", "groups", "trajectories"))
        st = point.state
        self.prompts.restore(st)
        self.rollouts.restarts = int(st.get("restarts", 0))
        ctx.event_counts["restart"] = int(st.get("sampler_restarts", 0))
        self.trainer_busy_s = float(st.get("trainer_busy_s", 0.0))
        ctx.continue_clock(float(st.get("elapsed_s", 0.0)))
        self.recorder.restore(st, float(st.get("elapsed_s", 0.0)))
        self.fleet.restart_clock()
        ctx.event("resume", version=ctx.version, detail=json.dumps(   # the ids this segment admits start there
            {"dropped_rows": dropped, "first_prompt_id": self.prompts.started,
             **({"recovered": list(point.notes)} if point.notes else {})}))
        if point.new_settings:      # --take-new-settings: the settings this segment runs with, saved -> new
            ctx.event("new_settings", version=ctx.version, detail=json.dumps(point.new_settings))
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
                            options=BatchOptions(top_k=self.settings.top_k_record, top_p_replay=self.top_p_replay,
                                                 normalize_std=self.settings.advantage_std))
        t0 = self.now()
        metrics = await self.trainer.train.remote(batch.tensors)
        dt = self.now() - t0
        self.trainer_busy_s += dt
        return batch, metrics, dt

    async def evaluate(self, version: int) -> float:
        from mixfleet.runner.rollout.evaluation import EvalConfig, pass_at_k_eval

        cfg = EvalConfig(task=self.task, task_options=self.settings.task_options, problems=self.settings.eval_problems,
                         k=self.pass_k, max_turns=self.agent_config.max_turns,
                         max_new_tokens=self.sampling.max_new_tokens, temperature=self.sampling.temperature,
                         top_p=self.settings.eval_top_p, seed=self.config.seed)
        res = await pass_at_k_eval(await self.weights.local_copy(), cfg)
        self.ctx.event("note", version=version, detail=json.dumps({
            "eval": "pass_at_k", "k": cfg.k, "version": version, "pass_at_k": res.pass_at_k,
            "reward": res.reward_mean, "problems": cfg.problems, "task": cfg.task, "temperature": cfg.temperature,
            "top_p": cfg.top_p, "max_new_tokens": cfg.max_new_tokens, "max_turns": cfg.max_turns,
            "precision": cfg.precision, "task_options": cfg.task_options, "seed": cfg.seed}),
            duration_s=res.wall_s)
        return res.pass_at_k

    async def _checkpoint(self) -> None:
        """The trainer's state and the orchestrator's (orchestrator.json) as one folder, replaced at once: both
        are written into the staging folder `.trainer_state.next`, which then replaces `trainer_state` by
        renames (`replace_dir_atomically`). A kill at any point leaves the previous checkpoint or this one,
        never a trainer state without its orchestrator state; `prepare_resume` puts back what a kill between
        the renames set aside."""
        state_dir = self.out / STATE_DIR
        staged = staging_dir(state_dir)
        try:
            if staged.exists():                                  # a killed checkpoint's: ours, unfinished
                shutil.rmtree(staged)
            await self.trainer.save_state.remote(str(staged))
            writepoints.reached("state")
            _write_json_durably(staged / ORCH_STATE_FILE, {
                "version": self.version, **self.prompts.state(), "restarts": self.restarts,
                "sampler_restarts": self.ctx.event_counts["restart"],
                "trainer_busy_s": self.trainer_busy_s, "elapsed_s": self.now(),
                **self.recorder.state(self._totals())})
            writepoints.reached("orchestrator")
            replace_dir_atomically(staged, state_dir)
            self._saved_version = self.version
        except Exception as e:                 # no space, an I/O error: one line, and the run stays resumable
            if actor_died(e) is not None:
                raise
            cause = write_failure(e, staged)
            with contextlib.suppress(OSError):                   # the cut write's space back; resume would too
                shutil.rmtree(staged)
            raise RunFailed(f"the checkpoint of update {self.version} could not be written to {state_dir}: {cause}; "
                            f"{resume_hint(self._saved_version)}") from None

    # ---- the loop --------------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        """Run until the trainer reaches `config.updates`; returns a summary dict."""
        ctx = self.ctx
        status = "failed"
        try:
            await self._start()
            self._saved_version = self.version                         # what the folder's checkpoint holds
            if ctx.fatal is not None:                                  # e.g. a planned group cannot start
                raise ctx.fatal
            ctx.spawn(self.fleet.monitor())
            if self.eval_every and self.settings.eval_at_start and self.version == 0:
                self.last_pass_at_k = await self.evaluate(0)
            self._loop_start_s, self._busy_at_loop_start_s = self.now(), self.trainer_busy_s
            ctx.spawn(self.rollouts.feeder())
            while self.version < self.target and not self.stop_requested:
                prompts = await self.next_batch()                      # generate (continuously) -> batch
                start_s = self.now()
                batch, metrics, train_s = await self.train(prompts)    # train (samplers keep sampling)
                sync_s = await self.weights.publish(self.trainer, batch.trained_version, self.fleet)
                ctx.version = batch.trained_version
                writepoints.begin(self.version)                        # the update's writes (tests die at one)
                writepoints.reached("published")
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
                writepoints.reached("checkpoint")
                writepoints.begin(None)
                if self.on_update is not None:
                    r = self.on_update(view, self)
                    if asyncio.iscoroutine(r):
                        await r
            status = "stopped" if self.version < self.target else "finished"
        except Exception as e:                  # an actor died (the trainer, a sampler): one line, not Ray's 150
            died = actor_died(e)
            if died is None and isinstance(e, OSError):        # the run log's own write (no space, I/O error)
                died = f"writing the run log in {self.out} failed: {write_failure(e, self.out)}"
            if died is None:
                raise
            raise RunFailed(f"{died}; {resume_hint(self._saved_version)}") from None
        except (SystemExit, KeyboardInterrupt, asyncio.CancelledError):
            status = "stopped"          # a signal ended it (a SIGTERM in Ray's start-up): resumable, not "running"
            raise
        finally:
            writepoints.begin(None)
            await self._stop(status)
        # "restarts": replicas restarted (the run log's "restart" events); "turns_rerun": turns sent again to
        # another replica after theirs was lost (one lost replica re-runs every turn it was serving)
        return {"version": self.version, "elapsed_s": self.now(), "restarts": self.ctx.event_counts["restart"],
                "turns_rerun": self.restarts,
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
        cpu: dict[str, float] = {}
        try:             # a SIGTERM in Ray's start-up (its handler exits) can fail these: the log is closed anyway
            await self.ctx.cancel_tasks()
            cpu = await self._cpu_seconds() if self.trainer is not None else {}
            await self.fleet.close()
            await self.weights.close()
            if self.trainer is not None:
                import ray

                with contextlib.suppress(Exception):
                    ray.kill(self.trainer, no_restart=True)
        finally:
            # on a full disk the header may not be written: the run's own error (one line) is what is reported,
            # and a resume reads the log as it is
            with contextlib.suppress(OSError):
                self.recorder.close(status, wall_s=self.now(), trainer_busy_s=self.trainer_busy_s,
                                    trainer_idle_share=1.0 - self.trainer_busy_s / max(self.now(), 1e-9),
                                    on_policy_kl_by_group=self.recorder.on_policy_kl(), cpu_s=cpu,
                                    lost_groups=dict(self.fleet.lost_groups),
                                    cpu_s_total=sum(cpu.values()), **self.loop_stats())
            if getattr(self, "_out_lock", None) is not None:   # the run log is closed: the folder is free
                self._out_lock.release()


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


def _write_json_durably(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


async def _trainer_version(trainer: Any, state_dir: Path | None) -> int:
    """The trainer actor's version once it is built; a trainer that cannot start (e.g. it refuses its saved
    state) is a RunFailed with its own error in one line, not Ray's wrapped traceback."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return int(await trainer.version.remote())
    except (RayActorError, RayTaskError) as e:
        what = f"refused its saved state {state_dir}" if state_dir is not None else "could not start"
        raise RunFailed(f"the trainer {what}: {trainer_error(e)}") from None
