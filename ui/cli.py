"""The `mixfleet` command line (typer).

Each area's commands live in their own module under `ui/commands/` and are added here by
`register(app)`, so that areas grow without touching each other. Command modules import heavy
libraries (torch, simpy, streamlit) inside the command functions, so `mixfleet --help` stays fast.
"""

from __future__ import annotations

import typer
from mixfleet.ui.commands import (
    calibrate,
    catalog,
    cleanup_cmd,
    engine,
    experiment,
    export,
    runner,
    sampler,
    twin,
    validate,
    webapp,
)

app = typer.Typer(
    name="mixfleet",
    help="Plan, dry-run and run LLM RL on mixed-precision, mixed-accelerator sampler fleets.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)



@app.callback()
def _root() -> None:
    """Plan, dry-run and run LLM RL on mixed-precision, mixed-accelerator sampler fleets."""


@app.command()
def version() -> None:
    """Print mixfleet's version."""
    from importlib.metadata import version as _v

    typer.echo(f"mixfleet {_v('mixfleet')}")


for _module in (catalog, twin, engine, sampler, runner, calibrate, validate, experiment, export, webapp,
                cleanup_cmd):
    _module.register(app)


def main() -> None:
    """Console entry point (`mixfleet`)."""
    app()


if __name__ == "__main__":
    main()
