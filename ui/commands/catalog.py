"""`mixfleet` commands: catalog and capacity: what each (accelerator, precision) replica can do and cost."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `mixfleet` app."""
