"""Where mixfleet's shipped data lives (data/ in the source tree, mixfleet/data when installed)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def data_dir() -> Path:
    """The folder holding accelerators.toml, precisions.toml, models/, workloads/, plans/."""
    return Path(str(resources.files("mixfleet.data")))


def data_path(*parts: str) -> Path:
    """A file under the data folder, e.g. `data_path("models", "tiny.toml")`."""
    return data_dir().joinpath(*parts)


def shipped_names(folder: str) -> list[str]:
    """Names of the TOML files shipped in data/<folder> (e.g. models, workloads)."""
    return sorted(p.stem for p in data_path(folder).glob("*.toml"))


def resolve_shipped(folder: str, name_or_path: str | Path, what: str) -> Path:
    """A shipped name (e.g. 'tiny') -> data/<folder>/<name>.toml, anything else -> the path as given.
    An unknown shipped name is a SpecError listing the known ones."""
    from mixfleet.costmodel.errors import SpecError

    path = Path(name_or_path)
    if path.suffix != ".toml" and len(path.parts) == 1:
        path = data_path(folder, f"{name_or_path}.toml")
        if not path.exists():
            raise SpecError(what, "name", str(name_or_path), shipped_names(folder))
    return path
