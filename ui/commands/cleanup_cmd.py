"""`mixfleet cleanup`: remove the sandboxes a killed driver left behind (runner/rollout/sandbox/runtime.py)."""

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
        """Kill the sandbox processes of drivers that are gone (e.g. after a kill -9), unmount and delete their
        work copies under the sandboxes' runtime folder ($MIXFLEET_SANDBOX_DIR or /tmp/mixfleet-sandboxes), and
        say what was removed. Sandboxes of live drivers are left alone unless --all."""
        from mixfleet.runner.rollout.sandbox import runtime

        kept = sum(1 for s in runtime.live_sandboxes() if s["owner_alive"]) if not all_owners else 0
        removed = runtime.cleanup(all_owners=all_owners)
        if as_json:
            typer.echo(json.dumps({"removed": removed, "kept_live": kept}, indent=1))
            return
        for r in removed:
            pids = ", ".join(map(str, r["killed_pids"])) or "none"
            typer.echo(f"removed {r['path']} (killed processes: {pids})" + ("" if r["removed"] else " [NOT deleted]"))
        typer.echo(f"cleanup: {len(removed)} sandbox(es) removed, {kept} of live drivers kept "
                   f"(in {runtime.root()})")
