"""`mixfleet run PLAN --out DIR`: a real run of a plan, with a rich live view (the command's body).

Kept apart from ui/commands/runner.py (which only registers the commands) so the run command and the
pretrain command can grow independently. Heavy imports (torch, ray) happen inside `run_command`.

Which samplers: `--embedded` (or a plan whose accelerators are all CPUs) rehearses every group locally as
embedded samplers in its precision / KV dtype / kernel; `--attach GROUP=URL` uses running servers;
otherwise each replica is a real SGLang server on a Ray cluster (`--address`) node carrying the group's
accelerator. The base policy is `--init DIR` or the cached `mixfleet pretrain` checkpoint.
"""

from __future__ import annotations

import math
from collections import deque
from pathlib import Path
from typing import Any

import typer


def _fmt(x: float, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


class LiveView:
    """The live table: last updates (reward, KL by group, staleness, tokens/s, pass@k) and recent events."""

    def __init__(self, plan_name: str, groups: list[str], target: int, quiet: bool = False) -> None:
        from rich.console import Console

        self.console = Console(stderr=False)
        self.plan_name, self.groups, self.target, self.quiet = plan_name, groups, target, quiet
        self.rows: deque[Any] = deque(maxlen=12)
        self.events: deque[str] = deque(maxlen=6)
        self.live: Any = None

    def __enter__(self) -> LiveView:
        if not self.quiet:
            from rich.live import Live

            self.live = Live(self.render(), console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.update(self.render())
            self.live.__exit__(*exc)

    def render(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        t = Table(title=f"mixfleet run: {self.plan_name}", title_justify="left")
        for col in ("update", "time s", "reward", "KL k3", *[f"KL {g}" for g in self.groups], "stale mean/max",
                    "tok/s", "tool s", "pass@k", "turns re-run", "trainer idle"):
            t.add_column(col, justify="right")
        for v in self.rows:
            t.add_row(f"{v.version}/{v.target}", _fmt(v.elapsed_s, ".0f"), _fmt(v.reward_mean), _fmt(v.kl_k3, ".2e"),
                      *[_fmt(v.kl_by_group.get(g, math.nan), ".2e") for g in self.groups],
                      f"{_fmt(v.staleness_mean, '.2f')}/{_fmt(v.staleness_max, '.0f')}", _fmt(v.tokens_per_s, ".0f"),
                      _fmt(v.tool_s, ".1f"), _fmt(v.pass_at_k, ".2f"), str(v.restarts),
                      _fmt(v.trainer_idle_share, ".0%"))
        ev = Table.grid()
        for line in self.events:
            ev.add_row(line)
        return Group(t, ev)

    def on_update(self, view: Any, _orch: Any) -> None:
        self.rows.append(view)
        if self.live is not None:
            self.live.update(self.render())
        else:
            kl = " ".join(f"{g}={_fmt(view.kl_by_group.get(g, math.nan), '.1e')}" for g in self.groups)
            self.console.print(f"update {view.version}/{view.target} t={view.elapsed_s:.0f}s reward "
                               f"{view.reward_mean:.3f} k3 {kl} stale {view.staleness_mean:.2f} "
                               f"tok/s {view.tokens_per_s:.0f} tool {_fmt(view.tool_s, '.1f')}s "
                               f"pass@k {_fmt(view.pass_at_k, '.2f')}", highlight=False)

    def on_event(self, rec: Any) -> None:
        if rec.kind in ("weight_push",):
            return
        where = f"{rec.group}#{rec.replica}" if rec.replica >= 0 else rec.group
        self.events.append(f"[{rec.time_s:7.1f}s] {rec.kind} {where} {rec.detail[:90]}")
        if self.live is not None:
            self.live.update(self.render())
        elif self.quiet and rec.kind not in ("note",):
            self.console.print(self.events[-1], highlight=False)


def _parse_attach(items: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        if "=" not in item:
            raise typer.BadParameter(f"--attach {item!r}: allowed GROUP=URL (e.g. H100-FP8=http://10.0.0.5:30000)")
        g, url = item.split("=", 1)
        out.setdefault(g.strip(), []).append(url.strip())
    return out


def _parse_kill_at(items: list[str], plan: Any, updates: int) -> dict[int, list[str]]:
    """--kill-at GROUP@UPDATE items as {update: [groups]}; a bad one is a SpecError naming the flag."""
    from mixfleet.costmodel.errors import SpecError

    names = [g.name for g in plan.groups]
    kills: dict[int, list[str]] = {}
    for item in items:
        g, sep, u = item.rpartition("@")
        if not sep or not g:
            raise SpecError("command line", "--kill-at", item, f"GROUP@UPDATE (e.g. {names[0]}@1)")
        if g not in names:
            raise SpecError("command line", "--kill-at", item, f"GROUP@UPDATE with GROUP one of the plan's groups "
                                                              f"({', '.join(names)})")
        try:
            at = int(u)
        except ValueError:
            at = 0
        if not u.strip().isdigit() or not 1 <= at <= updates:
            raise SpecError("command line", "--kill-at", item, f"GROUP@UPDATE with UPDATE an integer in 1..{updates} "
                                                              "(--updates)")
        kills.setdefault(at, []).append(g)
    return kills


def flag_overrides(settings: list[str], *, lr: float | None = None, eval_every: int | None = None,
                   task: str | None = None, trainer_threads: int | None = None,
                   task_set: str | None = None) -> dict[str, Any]:
    """The run's dotted plan overrides: each `--set KEY=VALUE` (recipe.py `parse_settings`) and the shorthand
    flags as the plan keys they are (`--lr X` is `embedded.lr=X`, `--eval-every`, `--task`, `--trainer-threads`,
    `--task-set DIR` is `embedded.task_options.task_set=DIR`). They go into the run's own plan (the run log records
    them, a `--resume` compares them); a key given twice is refused naming the flag."""
    from mixfleet.costmodel.errors import SpecError
    from mixfleet.runner.orchestration.recipe import parse_settings

    out = parse_settings(settings)
    for flag, key, value in (("--lr", "embedded.lr", lr), ("--eval-every", "embedded.eval_every", eval_every),
                             ("--task", "embedded.task", task),
                             ("--trainer-threads", "embedded.trainer_threads", trainer_threads),
                             ("--task-set", "embedded.task_options.task_set", task_set)):
        if value is None:
            continue
        if key in out:
            raise SpecError("command line", flag, value, f"given once ({key} is also given with --set)")
        out[key] = value
    return out


def run_command(plan_ref: str, out: Path, updates: int | None, resume: bool, embedded: bool, address: str | None,
                init: str | None, mode: str, attach: list[str], kill_at: list[str], eval_every: int | None,
                task: str | None, quiet: bool, trainer_threads: int | None = None, force: bool = False,
                allow_group_loss: bool = False, tracker: list[str] | None = None, lr: float | None = None,
                task_set: str | None = None, settings: list[str] | None = None,
                take_new_settings: bool = False) -> None:
    """Body of `mixfleet run` (see its help): the run is prepared by the runner's one recipe
    (runner/orchestration/recipe.py `prepare_run`: the overrides into the plan, the rehearsal, the locked folder,
    the base policy) and its lifecycle is the launcher's (runner/orchestration/launcher.py). Exit codes: 0 done
    or stopped, 1 the run failed or stopped on an error (run log kept), 2 bad input, 3 done without a sampler
    group that could not start (--allow-group-loss)."""
    import torch
    from mixfleet.costmodel.errors import SpecError
    from mixfleet.costmodel.records.trackers import LiveTracker
    from mixfleet.policies.plan import load_plan
    from mixfleet.runner.orchestration.recipe import prepare_run

    torch.set_num_threads(1)
    try:
        plan = load_plan(plan_ref)
        overrides = flag_overrides(list(settings or []), lr=lr, eval_every=eval_every, task=task,
                                   trainer_threads=trainer_threads, task_set=task_set)
        # what needs no folder is checked first (prepare_run checks the overrides before it writes anything)
        kills = _parse_kill_at(kill_at, plan, updates or 30)
        live = LiveTracker.from_options(tracker or [], out, resume=resume, force=force)   # --tracker (export's metrics)
        prepared = prepare_run(plan, overrides, out, updates=updates or 30, mode=mode, init=init, embedded=embedded,
                               address=address, attach=_parse_attach(attach), resume=resume, force=force,
                               take_new_settings=take_new_settings, allow_group_loss=allow_group_loss,
                               say=typer.echo)      # plain lines (the app shows them)
    except (SpecError, ValueError) as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    try:
        _run_locked(prepared.plan, prepared.config, out, quiet, kills, live)
    finally:
        prepared.release()


def _run_locked(plan: Any, cfg: Any, out: Path, quiet: bool, kills: dict[int, list[str]], live: Any = None) -> None:
    """The run itself through the launcher (SIGTERM: stop after the current update), with the live view and
    the --kill-at drill (the run folder is locked by the caller)."""
    from mixfleet.costmodel.errors import SpecError
    from mixfleet.costmodel.records.runlog import EventRecord
    from mixfleet.runner.checkpoint.hf_checkpoint import NonFiniteWeightsError
    from mixfleet.runner.orchestration import launcher
    from mixfleet.runner.orchestration.fleet import fleet_from_plan
    from mixfleet.runner.orchestration.orchestrator import RunFailed

    groups = list(fleet_from_plan(plan, mode=cfg.fleet_mode, attach=cfg.attach).group_names)
    view = LiveView(plan.name, groups, cfg.updates, quiet=quiet)

    def on_update(v: Any, orch: Any) -> None:
        view.on_update(v, orch)
        if live is not None:
            live.on_update(v.version)
        for g in kills.pop(v.version, []):
            idx = orch.kill_replica(g)
            view.on_event(EventRecord(time_s=v.elapsed_s, kind="note", group=g, replica=idx, version=v.version,
                                      detail="killed by --kill-at", duration_s=math.nan))

    with view:
        try:
            outcome = launcher.launch(plan, cfg, on_update=on_update, on_event=view.on_event,
                                      say=lambda line: print(line, flush=True))
        except RunFailed as e:
            typer.secho(f"error: the run failed: {e}; run log: {out}", fg=typer.colors.RED, err=True)
            raise typer.Exit(1) from None
        except (SpecError, ValueError) as e:
            cause = getattr(e, "cause", None) or e      # an actor's error arrives wrapped by Ray (with its traceback)
            if isinstance(cause, NonFiniteWeightsError):   # a diverged update: the run stopped, resumable
                typer.secho(f"error: the run stopped: {cause}; run log: {out} (resume with --resume)",
                            fg=typer.colors.RED, err=True)
                raise typer.Exit(1) from None
            typer.secho(f"error: {cause}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None
        finally:
            if live is not None:
                live.close()
    res = outcome.result
    typer.echo(f"{'stopped' if outcome.stopped else 'done'}: version {res['version']} in {res['elapsed_s']:.0f} s, "
               f"trainer idle {res['trainer_idle_share']:.0%}, sampler restarts {res['restarts']} "
               f"(turns re-run {res['turns_rerun']}); run log: {res['out']}")
    if res.get("lost_groups"):
        for g, why in res["lost_groups"].items():
            typer.secho(f"warning: sampler group {g!r} never started and was left out: {why}",
                        fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(3)


def register_run(app: typer.Typer) -> None:
    """Add `mixfleet run` to the app."""

    @app.command("run")
    def run(
        plan: str = typer.Argument(..., help="Plan file or shipped plan name (e.g. data/plans/tiny-cpu.toml)."),
        out: Path = typer.Option(..., "--out", "-o", help="Run folder: run log, trainer state, weights."),
        updates: int = typer.Option(30, "--updates", "-n", min=1, help="Trainer updates to reach."),
        resume: bool = typer.Option(False, "--resume", help="Continue a killed run from its last checkpoint."),
        force: bool = typer.Option(False, "--force", help="Replace what an earlier run or dry run wrote in --out "
                                                          "(never a folder mixfleet did not write)."),
        embedded: bool = typer.Option(False, "--embedded", help="Rehearse any plan locally with embedded samplers."),
        address: str = typer.Option(None, "--address", help="Ray cluster address (default: a local Ray)."),
        init: str = typer.Option(None, "--init", help="Base policy checkpoint (default: the cached pretrain)."),
        mode: str = typer.Option("async", "--mode", help="async (the seed's) or sync (generate, then train)."),
        attach: list[str] = typer.Option([], "--attach", help="GROUP=URL of a running sampler (repeatable)."),
        kill_at: list[str] = typer.Option([], "--kill-at", help="Fault drill: kill a GROUP replica after UPDATE "
                                                                "(GROUP@UPDATE, repeatable)."),
        eval_every: int = typer.Option(None, "--eval-every", min=0, help="pass@k every N updates (0: never): "
                                                                         "--set embedded.eval_every=N."),
        task: str = typer.Option(None, "--task", help="Task name: --set embedded.task=NAME (another task than "
                                 "the plan's starts its options afresh)."),
        task_set: str = typer.Option(None, "--task-set", help="A folder of repository tasks of your own for the repo "
                                     "task (docs/tasks.md): --set embedded.task_options.task_set=DIR."),
        trainer_threads: int = typer.Option(None, "--trainer-threads", min=1,
                                            help="Torch threads of the trainer: --set embedded.trainer_threads=N."),
        lr: float = typer.Option(None, "--lr", help="The trainer's learning rate (AdamW): --set embedded.lr=X "
                                                    "(docs/learning.md: 1.5e-4 learns on the asynchronous fleets, "
                                                    "3e-4 barely)."),
        settings: list[str] = typer.Option([], "--set", help="KEY=VALUE: a dotted plan key over the plan's value "
                                           "(e.g. embedded.lr=1.5e-4, embedded.eval_top_p=0.95), repeatable; "
                                           "recorded in the run's plan, so a --resume gives it again."),
        take_new_settings: bool = typer.Option(False, "--take-new-settings",
                                               help="With --resume: take run settings (embedded.*) that differ "
                                                    "from the saved run's (the run log records them) instead of "
                                                    "refusing the resume."),
        allow_group_loss: bool = typer.Option(False, "--allow-group-loss",
                                              help="Go on without a sampler group none of whose replicas can "
                                                   "start (reported; exit code 3) instead of failing the run."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Plain progress lines instead of the live view."),
        tracker: list[str] = typer.Option([], "--tracker", help="Stream the metrics to tensorboard or wandb (offline) "
                                          "after each update: NAME or NAME=DIR, repeatable (docs/runlog.md)."),
    ) -> None:
        """Run a plan for real: fully asynchronous RL, Megatron-core trainer, mixed samplers, the plan's policies.

        Exit codes: 0 done or stopped, 1 failed (log kept), 2 bad input, 3 done without a group (--allow-group-loss)."""
        if mode not in ("async", "sync"):
            typer.secho(f"error: --mode {mode!r}; allowed: async, sync", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
        run_command(plan, out, updates, resume, embedded, address, init, mode, attach, kill_at, eval_every, task,
                    quiet, trainer_threads, force, allow_group_loss, tracker, lr, task_set, settings,
                    take_new_settings)
