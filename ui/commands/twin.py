"""`mixfleet` commands: plan, simulate, compare: the twin and the mix planner."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `mixfleet` app."""
