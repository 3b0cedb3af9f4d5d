"""Where mixfleet's shipped data lives (data/ in the source tree, mixfleet/data when installed)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def data_dir() -> Path:
    """The folder holding accelerators.toml, precisions.toml, models/, workloads/, fleets/, plans/."""
    return Path(str(resources.files("mixfleet.data")))


def data_path(*parts: str) -> Path:
    """A file under the data folder, e.g. `data_path("models", "tiny.toml")`."""
    return data_dir().joinpath(*parts)
