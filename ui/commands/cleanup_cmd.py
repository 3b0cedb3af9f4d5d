"""`mixfleet cleanup`: stop what killed runs left behind, their local Ray (runner/orchestration/local_ray.py) and
their sandboxes (runner/rollout/sandbox/runtime.py)."""

from __future__ import annotations

import json

import typer


def register(app: typer.Typer) -> None:
    """Add `cleanup` to the `mixfleet` app."""

    @app.command("cleanup")
    def cleanup_cmd(
        all_owners: bool = typer.Option(False, "--all", help="Also remove sandboxes whose driver is still alive "
                                        "(kills their commands)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of lines."),
    ) -> None:
        """Stop what killed runs left behind: the local Ray (agents, workers) of every run whose driver is gone,
        and the sandboxes of such drivers (their processes killed, work copies under $MIXFLEET_SANDBOX_DIR or
        /tmp/mixfleet-sandboxes unmounted and deleted).

        Runs still going keep their Ray and sandboxes (sandboxes too with --all). Nothing that a mixfleet run did
        not start is touched: a Ray record is only a hint, and each process it names is stopped only if the
        process table shows it is that dead driver's Ray (this user's, Ray's command line, the run's token or its
        recorded pid and start time, no live owner), so a hand-written record stops nothing else."""
        from mixfleet.runner.orchestration.local_ray import records_dir, stop_leftover_rays
        from mixfleet.runner.rollout.sandbox import runtime

        stopped = stop_leftover_rays()
        kept = sum(1 for s in runtime.live_sandboxes() if s["owner_alive"]) if not all_owners else 0
        removed = runtime.cleanup(all_owners=all_owners)
        if as_json:
            typer.echo(json.dumps({
                "ray_stopped": [{"name": s.name, "pid": s.pid, "driver_pid": s.driver_pid} for s in stopped],
                "removed": removed, "kept_live": kept}, indent=1))
            return
        for s in stopped:
            typer.echo(f"stopped {s.name} (pid {s.pid}) of the dead driver {s.driver_pid}")
        typer.echo(f"{len(stopped)} leftover Ray process(es) stopped (records: {records_dir()})")
        for r in removed:
            pids = ", ".join(map(str, r["killed_pids"])) or "none"
            typer.echo(f"removed {r['path']} (killed processes: {pids})" + ("" if r["removed"] else " [NOT deleted]"))
        typer.echo(f"cleanup: {len(removed)} sandbox(es) removed, {kept} of live drivers kept "
                   f"(in {runtime.root()})")
