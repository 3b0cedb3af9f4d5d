"""`mixfleet` commands: serve, init-model, mismatch: the embedded sampler."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `mixfleet` app."""
