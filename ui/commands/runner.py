"""`mixfleet` commands: run, pretrain, evaluate: real runs (`cleanup` is in cleanup_cmd.py)."""

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

