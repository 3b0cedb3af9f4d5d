"""Where mixfleet's shipped data lives (data/ in the source tree, mixfleet/data when installed), and where it
keeps what it makes for itself (`cache_root`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any


def data_dir() -> Path:
    """The folder holding accelerators.toml, precisions.toml, models/, workloads/, plans/."""
    return Path(str(resources.files("mixfleet.data")))


def cache_root(part: str = "") -> Path:
    """Where mixfleet keeps what it makes between runs (`part`: `base` for base policies, `twin-checks`, `ray` for
    local Ray records, `ui` for the app's key): under `$MIXFLEET_CACHE`, else `$XDG_CACHE_HOME/mixfleet`, else
    `~/.cache/mixfleet`. (The twin checks' `$MIXFLEET_CACHE_DIR` and the Ray records' and app key's
    `$MIXFLEET_STATE_DIR` move those parts alone: twin/checks.py, runner/orchestration/local_ray.py.)"""
    if os.environ.get("MIXFLEET_CACHE"):
        return Path(os.environ["MIXFLEET_CACHE"]) / part
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mixfleet" / part


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
    if is_shipped_ref(name_or_path):
        path = data_path(folder, f"{name_or_path}.toml")
        if not path.exists():
            raise SpecError(what, "name", str(name_or_path), shipped_names(folder))
    return path


def is_shipped_ref(ref: str | Path) -> bool:
    """A reference that names a shipped file (one path component, no .toml suffix) rather than a path."""
    p = Path(ref)
    return p.suffix != ".toml" and len(p.parts) == 1


def confined_spec(folder: str, ref: Any, what: str, *, where: str, near: Path,
                  roots: Sequence[Path] = (), not_this: Path | None = None) -> Any:
    """A spec a plan names (its `model` or `workload`), under the rule of a plan's `base`: a shipped name
    (data/<folder>/<name>.toml; returned as is), or a .toml file inside the plan's own folder `near` (a relative
    path is taken from `near`, not from the working folder; no '..', no link out, not the plan file `not_this`
    itself; an absolute path only when it lies inside) or inside one of `roots`; such a file is returned as its
    resolved absolute path. Anything else is a SpecError naming the field, the value and what is allowed, and
    the file it names is never read, so an uploaded plan cannot make the server show another TOML's values.
    A value that is not a string is returned untouched (the plan's own check names it)."""
    from mixfleet.costmodel.errors import SpecError

    if not isinstance(ref, str) or not ref:
        return ref
    allowed = (f"a shipped {what} name ({', '.join(shipped_names(folder))}) or a .toml file inside the plan's own "
               f"folder (no '..', no link out of it)")
    if is_shipped_ref(ref):
        if not data_path(folder, f"{ref}.toml").is_file():
            raise SpecError(where, what, ref, allowed)
        return ref
    p = Path(ref)
    near_r = near.resolve()
    places = [near_r, *(r.resolve() for r in roots)]
    cand = (p if p.is_absolute() else near_r / p).resolve()
    ok = p.suffix == ".toml" and ".." not in p.parts and any(cand.is_relative_to(r) for r in places) \
        and (not_this is None or cand != not_this.resolve()) and cand.is_file()
    if not ok:
        raise SpecError(where, what, ref, allowed)
    return str(cand)
