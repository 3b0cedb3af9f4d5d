"""`mixfleet` commands: run, pretrain, evaluate, cleanup: real runs."""

from __future__ import annotations

import typer
from mixfleet.ui.commands.evaluate_cmd import register_evaluate
from mixfleet.ui.commands.pretrain_cmd import register_pretrain
from mixfleet.ui.commands.run_live import register_run


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `mixfleet` app."""
    register_run(app)
    register_pretrain(app)
    register_evaluate(app)

    @app.command("cleanup")
    def cleanup_cmd() -> None:
        """Stop what killed runs left behind: the local Ray (agents, workers) of every run whose driver is gone.

        Runs still going keep their Ray; nothing that a mixfleet run did not start is touched (the next
        `mixfleet run` does the same before it starts). A record is only a hint: each process it names is
        stopped only if the process table shows it is that dead driver's Ray (this user's, Ray's command line,
        the run's token or its recorded pid and start time, no live owner), so a hand-written record stops
        nothing else."""
        from mixfleet.runner.orchestration.local_ray import records_dir, stop_leftover_rays

        stopped = stop_leftover_rays()
        for s in stopped:
            typer.echo(f"stopped {s.name} (pid {s.pid}) of the dead driver {s.driver_pid}")
        typer.echo(f"{len(stopped)} leftover Ray process(es) stopped (records: {records_dir()})")
