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
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records import writepoints
from mixfleet.costmodel.records.ledger import GroupTotals, trainer_usd_per_hour
from mixfleet.costmodel.records.outdir import STAGING_SUFFIX, is_our_temp, lock_output_dir
from mixfleet.costmodel.records.runlog import EventRecord, RunLog, plan_changes
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.policies.plan import Plan, plan_from_dict
from mixfleet.policies.prompt_buffer import PromptBuffer, PromptGroup
from mixfleet.runner.checkpoint.hf_checkpoint import recover_replaced_dir, remove_leftovers, replace_dir_atomically
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


# ---- resume: what a kill left in the run folder, checked and put right before anything starts ------------
@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues (`prepare_resume`)."""

    version: int                          # the trainer version it continues from (0: the base policy)
    from_state: bool                      # a trainer state to load (False: nothing was checkpointed yet)
    state: dict[str, Any]                 # the orchestrator's checkpoint (orchestrator.json), or rebuilt from the log
    plan: dict[str, Any]                  # the plan as the run log recorded it
    notes: tuple[str, ...] = ()           # what was recovered or cleaned up
    new_settings: dict[str, list[Any]] = field(default_factory=dict)   # taken: {"embedded.lr": [saved, new]}


def staging_dir(state_dir: Path) -> Path:
    """Where `_checkpoint` puts a checkpoint together before it replaces `state_dir`."""
    return state_dir.with_name(f".{state_dir.name}{STAGING_SUFFIX}")


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


def _state_complete(d: Path) -> bool:
    return (d / "trainer_meta.json").is_file() and (d / "trainer_state.pt").is_file()


def _staged_complete(d: Path) -> bool:
    return _state_complete(d) and (d / ORCH_STATE_FILE).is_file()


def _recover_state_dir(state_dir: Path, *, apply: bool = True) -> tuple[Path, list[str]]:
    """Put back a trainer state that a kill between `replace_dir_atomically`'s renames set aside (or a complete
    staged checkpoint the kill kept from its rename), then delete the unfinished temp folders of the trainer
    state and of the staging folder (mixfleet's own names holding only trainer-state files). Returns where the
    state is (`state_dir`, or with `apply=False` the folder it would be restored from) and what was done."""
    notes = []
    staged = staging_dir(state_dir)
    try:
        src = recover_replaced_dir(state_dir, complete=_state_complete, fallback=staged, dry_run=not apply)
    except ValueError as e:
        raise SpecError("mixfleet run --resume", "--out", str(state_dir.parent), f"one trainer state ({e})") from None
    if src is not None:
        notes.append(f"restored {state_dir.name} from {src.name}")
        if not apply:
            return src, notes
    if apply and state_dir.is_dir():
        removed = remove_leftovers(state_dir, may_remove=is_our_temp)
        removed += remove_leftovers(staged, may_remove=is_our_temp)
        if staged.is_dir() and is_our_temp(staged):
            shutil.rmtree(staged)
            removed.append(staged.name)
        if removed:
            notes.append("removed unfinished " + ", ".join(sorted(removed)))
    return state_dir, notes


def _read_json_file(path: Path, what: str) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SpecError(str(path), "<file>", f"{type(e).__name__}: {e}", f"{what}, as JSON; the file is unreadable "
                        "or not valid JSON (cut or edited?): restore it, or start over with --force") from None
    if not isinstance(raw, dict):
        raise SpecError(str(path), "<file>", type(raw).__name__, f"{what}, as a JSON object")
    return raw


_ORCH_INTS = ("version", "started_prompts", "taken_prompts", "restarts", "trained_restarted")
_ORCH_FLOATS = ("elapsed_s", "trainer_busy_s")


def _check_orch_state(st: dict[str, Any], path: Path) -> dict[str, Any]:
    for k in _ORCH_INTS:
        if k in st and (isinstance(st[k], bool) or not isinstance(st[k], int) or st[k] < 0):
            raise SpecError(str(path), k, st[k], "an integer >= 0 (the file is not the orchestrator state "
                                                 "mixfleet wrote: restore it, or start over with --force)")
    for k in _ORCH_FLOATS:
        if k in st and (isinstance(st[k], bool) or not isinstance(st[k], int | float) or not math.isfinite(st[k])
                        or st[k] < 0):
            raise SpecError(str(path), k, st[k], "seconds >= 0 (the file is not the orchestrator state mixfleet "
                                                 "wrote: restore it, or start over with --force)")
    for k in ("cost_usd_by_group", "fresh_kl"):
        if k in st and not isinstance(st[k], dict):
            raise SpecError(str(path), k, st[k], "a JSON object of groups")
    return st


def _state_from_log(log: RunLog, version: int) -> dict[str, Any]:
    """An orchestrator state rebuilt from the run log, for a checkpoint without one (nothing checkpointed yet,
    or a trainer state written before orchestrator.json went into the same folder): prompt ids continue after
    the log's highest, the run clock after its last record, costs and trainer seconds as logged up to
    `version`. What the log does not hold (restarts, the on-policy KL sums) starts again from 0."""
    tr, up, gr, ev = log.trajectories, log.updates, log.groups, log.events
    ids = pd.to_numeric(tr["prompt_id"], errors="coerce").dropna() if len(tr) else pd.Series([], dtype=float)
    trained = tr[(tr["trained_version"] > 0) & (tr["trained_version"] <= version)] if len(tr) else tr
    ends = [float(x.max()) for x in (tr["end_s"], up["end_s"], ev["time_s"]) if len(x)]
    up_v = up[up["version"] <= version]
    gr_v = gr[gr["version"] <= version]
    return {"version": version, "started_prompts": int(ids.max()) + 1 if len(ids) else 0,
            "taken_prompts": int(trained["prompt_id"].nunique()) if len(trained) else 0,
            "elapsed_s": max([0.0, *ends]), "trainer_busy_s": float(up_v["train_step_s"].sum()),
            "cost_usd_by_group": {str(g): float(c) for g, c in gr_v.groupby("group")["cost_usd"].sum().items()},
            "trained_restarted": int((trained["restarts"] > 0).sum()) if len(trained) else 0}


# the run settings a resumed run may take from a changed plan (`take_new_settings`): the plan's [embedded] table
# but the base policy's pretraining and the fleet's scale-down (they would make another run)
NOT_TAKEN = ("embedded.base_steps", "embedded.max_replicas_per_group")


def takeable(key: str) -> bool:
    """A plan field a resume may take with `take_new_settings` (a run setting, `NOT_TAKEN` aside)."""
    return key.startswith("embedded.") and not key.startswith(NOT_TAKEN)


def prepare_resume(out: Path, plan: Plan, *, where: str = "mixfleet run --resume",
                   apply: bool = True, take_new_settings: bool = False) -> ResumePoint | None:
    """Check that the run in `out` can continue with `plan`, and put right what a kill left (under the run
    folder's lock): None when there is no run log yet (a new run). Refused (SpecError, nothing changed):

    - a different plan than the log's (the resolved plans are compared, not the file names), naming each
      differing field with the saved and the given value; with `take_new_settings` differing run settings
      (embedded.*, `takeable`) are taken instead and returned in `new_settings` (the resume event logs them);
    - a trainer state that is gone while the log holds updates after update 1 (their rows came from it: they
      cannot be continued); a state set aside by a killed replace (`.trainer_state.old.<pid>`) is put back;
    - a trainer_meta.json or orchestrator.json that is unreadable, not JSON or of the wrong types (named).

    The log is rolled back to the checkpoint: a run log without a trainer state whose updates are none or
    update 1 only (killed, or out of space, before its first checkpoint completed) continues from the base
    policy in the same log, update 1's rows rolled back by the run (`truncate_after_version`), as a later
    update's rows are after the checkpoint of the update before it. `apply=False` changes nothing (a check before the
    run starts: the run's own call then recovers and records it in its resume event)."""
    out = Path(out)
    state_dir = out / STATE_DIR
    if not (out / "run.json").exists():
        if state_dir.exists() or any(out.glob(f".{STATE_DIR}.old.*")):
            raise SpecError(where, "--out", str(out), "a run folder with its run log; it has a trainer state but no "
                                                      "run.json: restore run.json, or choose another folder")
        return None
    log = RunLog.open(out)
    recorded = log.header.get("plan")
    try:
        normal = plan_from_dict(dict(recorded)).to_dict() if isinstance(recorded, dict) else recorded
    except (SpecError, TypeError, ValueError):
        normal = recorded                          # a plan of an older schema: compared as recorded
    changes = plan_changes(normal, plan.to_dict())
    refused = {k: v for k, v in changes.items() if not (take_new_settings and takeable(k))}
    if refused:
        name = recorded.get("name") if isinstance(recorded, dict) else None
        diff = [f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in refused.items()]
        more = f" and {len(diff) - 6} more" if len(diff) > 6 else ""
        take = "" if take_new_settings or not all(takeable(k) for k in refused) else \
            ", or take the new settings with --take-new-settings (take_new_settings=True; the run log records them)"
        first = next(iter(refused))
        raise SpecError(where, first, refused[first][1], f"the saved run's value (the run in {out} was started "
                        f"with plan {name!r}, as its run.json records it; this plan differs in {len(diff)} field(s): "
                        f"{'; '.join(diff[:6])}{more}). Resume with the same plan and settings{take}, or start a new "
                        "run (another --out, or --force to replace this one)")
    new_settings = {k: v for k, v in changes.items() if k not in refused}
    found, notes = _recover_state_dir(state_dir, apply=apply)
    up = log.updates
    if not _state_complete(found):
        if len(up) and int(up["version"].max()) > 1:
            n_tr = int((log.trajectories["trained_version"] > 0).sum())
            raise SpecError(where, "--out", str(out), f"a run whose trainer state is there to continue from; "
                            f"{state_dir} is {'incomplete' if state_dir.exists() else 'missing'} (and no old copy is "
                            f"beside it), but the run log holds updates {int(up['version'].min())}.."
                            f"{int(up['version'].max())} ({n_tr} trained trajectories) that came from it, so they "
                            "cannot be continued; nothing was changed. Put the trainer_state folder back, or start "
                            "over with --force (replaces this run) or another --out")
        if len(up):           # update 1 logged, its checkpoint never completed (a kill, a full disk): rolled back
            notes.append("update 1's checkpoint was never completed: its rows are rolled back")
        return ResumePoint(version=0, from_state=False, state=_state_from_log(log, 0), plan=dict(recorded or {}),
                           notes=(*notes, "no checkpoint yet: continues from the base policy"),
                           new_settings=new_settings)
    meta = _read_json_file(found / "trainer_meta.json", "the trainer's checkpoint metadata")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise SpecError(str(found / "trainer_meta.json"), "version", version, "an integer >= 0")
    orch_path = found / ORCH_STATE_FILE
    if orch_path.exists():
        st = _check_orch_state(_read_json_file(orch_path, "the orchestrator's checkpoint"), orch_path)
        if st.get("version", version) != version:
            raise SpecError(str(orch_path), "version", st.get("version"), f"{version}, the version of the trainer "
                            "state beside it (these files are not one checkpoint: restore them, or start over "
                            "with --force)")
    else:
        st = _state_from_log(log, version)
        notes.append(f"no {ORCH_STATE_FILE}: prompt ids, clock and costs rebuilt from the run log")
    return ResumePoint(version=version, from_state=True, state=st, plan=dict(recorded or {}), notes=tuple(notes),
                       new_settings=new_settings)


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


async def _trainer_version(trainer: Any, state_dir: Path | None) -> int:
    """The trainer actor's version once it is built; a trainer that cannot start (e.g. it refuses its saved
    state) is a RunFailed with its own error in one line, not Ray's wrapped traceback."""
    from ray.exceptions import RayActorError, RayTaskError

    try:
        return int(await trainer.version.remote())
    except (RayActorError, RayTaskError) as e:
        what = f"refused its saved state {state_dir}" if state_dir is not None else "could not start"
        raise RunFailed(f"the trainer {what}: {trainer_error(e)}") from None
