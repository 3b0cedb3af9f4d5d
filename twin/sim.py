"""`simulate(plan)`: dry-run a plan in the twin, write its run log, return the summary.

The plan's policies (the same classes the runner uses) drive a `World` (world.py) whose replicas
take their rates from the cost model (rates.py); the run log is written with costmodel's
RunLogWriter (source "twin") and summarized with costmodel's runsummary, so a dry run and a real
run are read and compared by the very same code. Deterministic for a given plan and seed.
"""

from __future__ import annotations

import gc
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixfleet.costmodel.records.outdir import lock_output_dir
from mixfleet.costmodel.records.runlog import RunLogWriter
from mixfleet.costmodel.records.runsummary import RunSummary, summarize
from mixfleet.policies.plan import Plan, load_plan
from mixfleet.twin.rates import Setup, build_setup
from mixfleet.twin.world import World, run_loop

if TYPE_CHECKING:
    from mixfleet.costmodel.calibration.record import Calibration


@dataclass(frozen=True, kw_only=True)
class TwinResult:
    """A dry run's outcome: the run-log summary plus what only the twin knows."""
    summary: RunSummary              # costmodel.records.runsummary over the run log
    runlog_dir: str                  # "" when the log went to a temporary folder
    updates: int
    simulated_s: float               # simulated seconds
    wall_s: float                    # seconds the simulation took
    events: int                      # SimPy events scheduled
    events_per_s: float
    sessions_started: int
    trajectories_trained: int
    trajectories_dropped: int
    trajectories_in_flight: int      # started but not finished or waiting in the buffer at the end
    trajectories_buffered: int       # finished, waiting for a later update at the end
    turns_lost: int                  # turns cut by a replica loss (each resumed or restarted)
    sessions_restarted: int
    reroutes: int                    # sessions moved to another replica by the router
    group_kl_k3: dict[str, float]    # predicted (prior) KL per group, staleness-adjusted
    group_extreme_share: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["summary"] = self.summary.to_dict() if hasattr(self.summary, "to_dict") else asdict(self.summary)
        return _json_safe(d)


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def simulate(plan: Plan | str | Path, *, updates: int = 20, seed: int | None = None, out: str | Path | None = None,
             price_table: str | None = None, setup: Setup | None = None, calibration: Calibration | None = None,
             truth: Calibration | None = None, progress: Callable[[int], None] | None = None,
             warm_start: bool = False) -> TwinResult:
    """Dry-run `plan` for `updates` trainer updates.

    plan: a Plan, a plan file path or a shipped plan name. seed: overrides the plan's. out: the run-log
    folder (None: a temporary one, removed after summarizing). price_table: overrides the plan's.
    setup: the world's numbers (default: from the cost model, `build_setup`); tests pass their own.
    calibration: a costmodel Calibration: its fitted values in place of the cost model's priors for the groups and
    trainer it covers (`build_setup(plan, calibration=...)`; ignored when `setup` is given).
    truth: a Calibration the simulated world runs on instead, while what plans and re-plans (the `replan`
    autoscaler's solver) starts from `calibration` (None: the priors): a bench for the re-planning loop, e.g.
    one group slower than its prior (`twin.replan.perturbed_truth`). Recorded in the header as `truth`.
    progress: called with each finished update's number (1..updates).
    warm_start: begin near the steady state (sessions and prompt-groups at the ages the workload implies,
    `World.seed_steady_state`; update versions then start above 1) instead of from empty pipelines.
    """
    plan = plan if isinstance(plan, Plan) else load_plan(plan)
    if updates < 1:
        from mixfleet.costmodel.errors import SpecError
        raise SpecError("simulate", "updates", updates, "an integer >= 1")
    seed = plan.seed if seed is None else seed
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:   # numpy's generators take seeds >= 0
        from mixfleet.costmodel.errors import SpecError
        raise SpecError("simulate", "seed", seed, "an integer >= 0")
    setup = setup or build_setup(plan, price_table=price_table, calibration=truth or calibration)
    folder = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="mixfleet-twin-"))
    wall0 = time.perf_counter()
    gc_thresholds = gc.get_threshold()
    gc.set_threshold(100_000, 50, 100)  # the run holds ~1e6 small live objects: collect cycles less often
    # one writer per run-log folder, as a real run (re-entrant: `mixfleet simulate` took it before its check)
    lock = lock_output_dir(folder, where="mixfleet simulate") if out is not None else None
    try:
        header = {"source": "twin", "plan": plan.to_dict(), "seed": seed, "clock": "simulated",
                  **({"warm_start": True} if warm_start else {}),
                  **({"truth": truth.to_dict()} if truth is not None else {})}
        with RunLogWriter(folder, header, flush_every_rows=50_000, flush_every_s=None) as writer:
            policies = plan.build_policies(setup.workload)
            if hasattr(policies["autoscaler"], "attach"):   # the re-planner reads the run, re-solves (planner.solver)
                from mixfleet.planner.solver import solver_for
                policies["autoscaler"].attach(writer, solver_for(plan, calibration))
            world = World(groups=setup.groups, trainer=setup.trainer, workload=setup.workload,
                          policies=policies, seed=seed, writer=writer,
                          run_id=writer.run_id, preemptions_per_replica_hour=plan.faults.preemptions_per_replica_hour,
                          on_loss=plan.faults.on_loss, progress=progress, sandbox=setup.sandbox)
            done = world.env.process(run_loop(world, updates, warm_start=warm_start))
            world.env.run(until=done)
            if world.stalled is not None:
                raise world.stalled
            wall_s, events = time.perf_counter() - wall0, world.env.scheduled
            writer.update_header(wall_s=wall_s, simulated_s=world.env.now, events=events)
    finally:
        gc.set_threshold(*gc_thresholds)
        if lock is not None:
            lock.release()
    summary = summarize(folder)
    trained = world.trajectories_written - world.trajectories_dropped
    buffered = sum(len(p.samples) for p in world.prompts.complete.values())
    finished_inflight = sum(len(p.samples) for p in world.prompts.inflight.values())
    result = TwinResult(
        summary=summary, runlog_dir=str(folder) if out is not None else "", updates=updates,
        simulated_s=world.env.now, wall_s=wall_s, events=events, events_per_s=events / max(wall_s, 1e-9),
        sessions_started=world.sessions_started,
        trajectories_trained=trained, trajectories_dropped=world.trajectories_dropped,
        trajectories_in_flight=world.sessions_started - world.trajectories_written - buffered - finished_inflight,
        trajectories_buffered=buffered + finished_inflight, turns_lost=world.sessions_lost,
        sessions_restarted=world.sessions_restarted, reroutes=world.router.reroutes,
        group_kl_k3=dict(summary.group_kl_k3) if hasattr(summary, "group_kl_k3") else {},
        group_extreme_share=dict(summary.group_extreme_share))
    if out is None:
        shutil.rmtree(folder, ignore_errors=True)
    return result
