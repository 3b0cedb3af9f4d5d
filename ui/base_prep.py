"""The base policy an app run starts from, prepared before the run (issue 44: the first real run pretrained the
tiny base for about 10 minutes under load inside its "starting" phase, and nothing offered to prepare it
beforehand).

`base_of(plan_toml)` is the cached `mixfleet pretrain` checkpoint an embedded rehearsal of the plan starts from
when it is given none (the same transform and key as `mixfleet run --embedded`: runner/orchestration/recipe.py
`prepare_run`), and whether the cache holds it. `start(plan_toml)` trains it in a background process of its own
(`python -m mixfleet.ui.base_prep PLAN`, logging "pretraining the base policy: ..." lines to a file in the app's
state folder); the cache write is atomic, so a run started meanwhile that trains the same key is safe.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROCS: dict[str, subprocess.Popen[bytes]] = {}   # cache key -> this app's process preparing it


@dataclass(frozen=True)
class Base:
    key: str               # the pretrain cache key
    path: Path             # where the cache keeps it
    command: str           # the same as a command line
    cached: bool           # the cache holds it: a run starts without pretraining


def _rehearsed(plan_toml: str) -> Any:
    import tomllib

    from mixfleet.policies.plan import plan_from_dict
    from mixfleet.runner.orchestration.rehearsal import rehearsal_of

    return rehearsal_of(plan_from_dict(tomllib.loads(plan_toml))).plan


def base_of(plan_toml: str) -> Base:
    """The base an embedded rehearsal of this plan starts from (raises the rehearsal's SpecError when it cannot
    run here)."""
    from mixfleet.runner.orchestration.pretrain import META_FILE, cache_key, default_cache_dir, plan_base_config

    cfg = plan_base_config(_rehearsed(plan_toml))
    key = cache_key(cfg)
    path = default_cache_dir() / key
    return Base(key=key, path=path, cached=(path / META_FILE).is_file(),
                command=f"mixfleet pretrain --model {cfg.model} --task {cfg.demos.task} --steps {cfg.steps}")


def _folder() -> Path:
    from mixfleet.runner.orchestration.local_ray import state_dir

    return state_dir() / "base-prep"


def log_path(key: str) -> Path:
    return _folder() / f"{key}.log"


def preparing(key: str) -> bool:
    p = PROCS.get(key)
    return p is not None and p.poll() is None


def start(plan_toml: str) -> Base:
    """Train the plan's base in the background (nothing when it is cached or already being prepared here)."""
    base = base_of(plan_toml)
    if base.cached or preparing(base.key):
        return base
    folder = _folder()
    folder.mkdir(parents=True, exist_ok=True)
    plan_file = folder / f"{base.key}.toml"
    plan_file.write_text(plan_toml)
    with log_path(base.key).open("wb") as log:
        PROCS[base.key] = subprocess.Popen([sys.executable, "-m", "mixfleet.ui.base_prep", str(plan_file)],
                                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
    return base


def last_line(key: str) -> str:
    """While it runs, the preparing process's last progress line ("pretraining the base policy: steps 40/150, loss
    1.234"); once it ended, its last line (an error's)."""
    from mixfleet.runner.orchestration.recipe import PRETRAIN_LINE

    try:
        lines = log_path(key).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    said = [ln for ln in lines if ln.startswith(PRETRAIN_LINE)]
    if preparing(key) and said:
        return said[-1]
    return lines[-1] if lines else ""


def main(plan_file: str) -> None:
    from mixfleet.runner.orchestration.recipe import base_policy

    path = base_policy(_rehearsed(Path(plan_file).read_text()), lambda s: print(s, flush=True))
    print(f"base policy ready: {path}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
