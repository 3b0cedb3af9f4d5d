"""One recipe for a real run: (plan, overrides, folder) -> everything the run needs, the same for every front end.

`prepare_run(plan, overrides, out, ...)` is what `mixfleet run` (ui/commands/run_live.py, and through it the app's
"Run for real", ui/run_manager.py), a study's child run (studies/runs.py `run_child`) and the benchmarks
(benchmarks/async_vs_sync.py) do before `launcher.launch`:

1. the overrides, dotted plan keys (`{"embedded.lr": 1.5e-4}`, `mixfleet run --set embedded.lr=1.5e-4`), go into
   the plan itself (`policies.plan.with_overrides`: an unknown key or a bad value is the plan's SpecError naming
   the field, the value and what is allowed), so the run log's plan says what ran and a resume compares them;
2. the plan's task is checked against the runner's tasks (`config.check_plan_task`);
3. the fleet mode (`launcher.fleet_mode`) and, for embedded samplers, the plan's rehearsal on this machine
   (rehearsal.py `rehearsal_of`: the plan that runs);
4. the run folder is claimed and checked (`launcher.prepare`: a new or empty folder, `force`, or the run a
   resume continues, its plan compared with the saved one; `take_new_settings` takes differing embedded.*
   settings). `claim=False` for a caller that manages the folder itself (a study's child): a resume is still
   checked, and the orchestrator takes the folder's lock when it starts;
5. the base policy: `init`, else the cached `mixfleet pretrain` of the plan's model, task and embedded.base_steps
   (trained now if missing, its progress as `PRETRAIN_LINE` lines through `say`);
6. the `RunConfig`: what the run needs beyond its plan (nothing in it is a plan setting).

The re-planner's solver is not handed over here: the orchestrator attaches `planner.solver.solver_for(plan)` to a
`replan` autoscaler itself, so every run of such a plan has it, however it was started.

The on-policy loop in one process (onpolicy.py, the learning ladder's first rung and the CI learning test) is not a
run of a plan and does not use this recipe; a plan's on-policy run is `mode="sync"` (`mixfleet run --mode sync`):
the same loop, the batcher at `max_staleness = 0`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError
from mixfleet.policies.plan import Plan, with_overrides
from mixfleet.runner.orchestration.config import DEFAULT_TASK, RunConfig, check_plan_task, run_settings, task_of

PRETRAIN_LINE = "pretraining the base policy: "    # what the app's "starting" banner looks for (ui/app_launch.py)


def parse_settings(items: Sequence[str], *, where: str = "command line", flag: str = "--set") -> dict[str, Any]:
    """`KEY=VALUE` items as {dotted plan key: value}: VALUE is read as a TOML value (`1.5e-4`, `true`, `"x"`,
    `{task_set = "d"}`), else taken as the text itself (`repo`). A malformed item is a SpecError naming the flag;
    the keys and values are checked by the plan (`apply_overrides`)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part.isidentifier() for part in key.split(".")):
            raise SpecError(where, flag, item, "KEY=VALUE with KEY a dotted plan key (e.g. embedded.lr=1.5e-4)")
        if key in out:
            raise SpecError(where, flag, item, f"each key once ({key} is given twice)")
        try:
            out[key] = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = text.strip()
    return out


def apply_overrides(plan: Plan, overrides: Mapping[str, Any]) -> Plan:
    """`plan` with the dotted-key `overrides` written into it (the plan as it is when there are none); an unknown
    key or a bad value is the plan's own SpecError (field, value, allowed). An `embedded.task` other than the
    plan's task starts its `task_options` afresh (another task's options would not fit it) unless options are
    given too; an `embedded.task_options.task_set` needs the repo task (a SpecError naming the key)."""
    if not overrides:
        return plan
    over = dict(overrides)
    task = over.get("embedded.task")
    if task is not None and (task or DEFAULT_TASK) != task_of(plan) and \
            not any(k.startswith("embedded.task_options") for k in over):
        plan = dataclasses.replace(plan, embedded=dataclasses.replace(run_settings(plan), task_options={}))
    plan = with_overrides(plan, over)
    if "embedded.task_options.task_set" in over and task_of(plan) != "repo":
        raise SpecError("override", "embedded.task_options.task_set", over["embedded.task_options.task_set"],
                        f"a task set needs the repo task; the task is {task_of(plan)!r} (add embedded.task=repo, "
                        "--task repo)")
    return plan


def pretrain_lines(say: Callable[[str], Any]) -> tuple[Callable[[int, int], None], Callable[[int, int, dict], None]]:
    """`pretrain`'s two progress callbacks as plain lines through `say` (the driver log the app shows while a
    run starts), one every tenth of each phase: "pretraining the base policy: demonstrations 200/2000"."""
    said: dict[str, int] = {}

    def line(phase: str, done: int, total: int, tail: str = "") -> None:
        tenth = done * 10 // max(total, 1)
        if said.get(phase, -1) < tenth:
            said[phase] = tenth
            say(f"{PRETRAIN_LINE}{phase} {done}/{total}{tail}")

    return (lambda d, n: line("demonstrations", d, n)), (lambda s, n, m: line("steps", s, n, f", loss {m['loss']:.3f}"))


def base_policy(plan: Plan, say: Callable[[str], Any] | None = print) -> str:
    """The cached `mixfleet pretrain` checkpoint of the plan's model, task and embedded.base_steps (trained now if
    missing: minutes on a CPU), its progress as plain lines through `say` (None: silent)."""
    from mixfleet.runner.orchestration.pretrain import plan_base_config, pretrain

    cfg = plan_base_config(plan)
    if say is None:
        return str(pretrain(cfg).path)
    say(f"base policy: the cached `mixfleet pretrain --model {cfg.model} --task {cfg.demos.task} "
        f"--steps {cfg.steps}` checkpoint (trained if missing)...")
    demos, steps = pretrain_lines(say)
    return str(pretrain(cfg, demo_progress=demos, progress=steps).path)


@dataclass(frozen=True)
class PreparedRun:
    """A run ready to launch (`launcher.launch(prepared.plan, prepared.config)`); `release()` the folder's lock
    when it ends (the run takes the lock again, re-entrantly)."""

    plan: Plan                       # the plan that runs: overrides applied, rehearsed for embedded samplers
    config: RunConfig
    rehearsal: Any | None            # rehearsal.py `Rehearsal` (embedded samplers), else None
    lock: Any | None                 # the run folder's lock (None: claim=False)

    @property
    def base_policy(self) -> str:
        return self.config.init_checkpoint

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def prepare_run(plan: Plan, overrides: Mapping[str, Any], out: str | Path, *, updates: int = 30,
                mode: str = "async", init: str | None = None, embedded: bool = False, address: str | None = None,
                attach: Mapping[str, Sequence[str]] | None = None, resume: bool = False, force: bool = False,
                take_new_settings: bool = False, claim: bool = True, seed: int = 0, ray_num_cpus: int | None = None,
                allow_group_loss: bool = False, batcher_overrides: Mapping[str, Any] | None = None,
                say: Callable[[str], Any] | None = print, where: str = "mixfleet run") -> PreparedRun:
    """The recipe (module doc). Bad input is a SpecError (or ValueError) naming the field before anything is
    written; the folder's lock is released when a later step fails."""
    from mixfleet.runner.orchestration import launcher
    from mixfleet.runner.orchestration.resume import prepare_resume

    out = Path(out)
    plan = apply_overrides(plan, overrides)
    check_plan_task(plan)
    if take_new_settings and not resume:
        raise SpecError(where, "--take-new-settings", True, "with --resume only (it takes a resumed run's settings)")
    attach_map = {g: list(urls) for g, urls in (attach or {}).items()}
    fleet_mode = launcher.fleet_mode(plan, embedded=embedded, address=address, attach=attach_map)
    rehearsal = None
    if fleet_mode == "embedded":     # the plan's own fleet scaled to this machine (orchestration/rehearsal.py)
        from mixfleet.runner.orchestration.rehearsal import rehearsal_of

        rehearsal = rehearsal_of(plan)
        plan = rehearsal.plan
    lock = None
    if claim:     # one writer per run folder; a resume checked (nothing changed) before the base policy and Ray
        lock = launcher.prepare(out, plan, resume=resume, force=force, where=where,
                                take_new_settings=take_new_settings)
    elif resume:
        prepare_resume(out, plan, where=where, apply=False, take_new_settings=take_new_settings)
    try:
        if rehearsal is not None and say is not None:
            for line in rehearsal.lines():
                say(line)
        config = RunConfig(out_dir=out, updates=updates, init_checkpoint=init or base_policy(plan, say), mode=mode,
                           fleet_mode=fleet_mode, attach=attach_map, address=address, resume=resume,
                           take_new_settings=take_new_settings, batcher_overrides=dict(batcher_overrides or {}),
                           seed=seed, ray_num_cpus=ray_num_cpus, allow_group_loss=allow_group_loss)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return PreparedRun(plan=plan, config=config, rehearsal=rehearsal, lock=lock)
