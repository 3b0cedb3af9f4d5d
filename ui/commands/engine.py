"""`mixfleet` commands: init-model, mismatch: checkpoints and measured precision mismatch of the embedded engine."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `mixfleet` app."""
