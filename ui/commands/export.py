"""`mixfleet export RUNLOG --to tensorboard|wandb`: a run log's metrics (twin or real) where RL people look.

Rendering only: the mapping and the writers are `mixfleet.costmodel.records.trackers` (the same ones `mixfleet run
--tracker` streams through). Bad input (an unknown --to, a folder that is not a run log, the trackers extra not
installed, a destination that already has event files) prints one line and exits with 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add `export` to the `mixfleet` app."""

    @app.command("export")
    def export_cmd(
        runlog: Path = typer.Argument(..., help="A run-log folder (mixfleet simulate --out or mixfleet run --out)."),
        to: str = typer.Option(..., "--to", help="tensorboard or wandb (offline: no account, no network)."),
        out: Path = typer.Option(None, "--out", "-o", help="TensorBoard: the logdir of this run (default "
                                 "RUNS/tensorboard/<run>, beside the run folder); wandb: the folder that gets "
                                 "wandb/offline-run-* (default: the run folder's parent)."),
        force: bool = typer.Option(False, "--force", help="Replace the TensorBoard event files already in --out."),
        as_json: bool = typer.Option(False, "--json", help="Print what was written as JSON."),
    ) -> None:
        """Write a run log's metrics to TensorBoard event files or an offline wandb run: step = trainer version;
        train/*, staleness/*, time/*, cost/*, group/<name>/*, rollout/*, eval/* (docs/runlog.md, "Trackers")."""
        from mixfleet.costmodel.errors import SpecError
        from mixfleet.costmodel.records.trackers import export_run_log

        try:
            res = export_run_log(runlog, to, out, force=force)
        except SpecError as e:
            typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None
        if as_json:
            typer.echo(json.dumps({"tracker": res.tracker, "dest": str(res.dest), "steps": res.steps,
                                   "values": res.values, "metrics": res.metrics}, indent=2))
            return
        typer.echo(f"exported {res.steps} steps ({res.values} values, {len(res.metrics)} metrics) of {runlog} "
                   f"to {res.tracker}: {res.dest}")
        if res.tracker == "tensorboard":
            typer.echo(f"view: tensorboard --logdir {res.dest.parent}   (every run exported beside it, side by side)")
        else:
            typer.echo(f"upload when online: wandb sync {res.dest}")
