"""May I write here? The one check every command that writes an output folder makes first.

A destination is fine when it does not exist or is an empty folder. A folder that already holds
something is refused (never silently replaced or appended to) unless:

- it is a run of the same kind and the command continues it (`--resume`, `mixfleet run` only), or
- it is recognisably mixfleet's own output (a run, a twin run log, a checkpoint) and the user passed
  `--force`: then it is replaced.

A folder that holds anything mixfleet did not write (an unknown file name, a run.json of another format)
is never replaced, `--force` or not: mixfleet deletes only what it wrote. A path that is a file is refused.
The kinds are recognised by their marker file and by holding only the names that kind writes (below; the
writers are costmodel/runlog.py, runner/orchestration and runner/checkpoint).

No torch, no mixfleet imports but errors: this module is part of costmodel/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError

RUNLOG_ENTRIES = frozenset({"run.json", "trajectories", "updates", "groups", "events"})
# a real run folder also holds the trainer's state and the exported weights (runner/orchestration) and
# a driver log (studies/ablation.py)
RUN_ENTRIES = RUNLOG_ENTRIES | {"trainer_state", "weights", "driver.log", "node_cache"}
CHECKPOINT_ENTRIES = frozenset({"config.json", "model.safetensors", "tokenizer.json", "pretrain.json"})
# temp / old names our atomic writers leave behind when killed (".run.json.ab12cd34.tmp", ".ckpt.old.123")
_OUR_TEMP = re.compile(r"^\..*(\.tmp|\.old\.\d+)$")


def _header(path: Path) -> dict[str, Any] | None:
    try:
        h = json.loads((path / "run.json").read_text())
    except (OSError, ValueError):
        return None
    return h if isinstance(h, dict) and h.get("format") == "mixfleet-runlog" else None


def _is_checkpoint(path: Path) -> bool:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "mixfleet_weight_version" in cfg


@dataclass(frozen=True)
class OutputKind:
    """What a command writes: recognised by `marker` and by holding only `entries` (plus our temp names)."""

    name: str
    label: str                                  # for messages: "a run", "a twin run log", "a checkpoint"
    entries: frozenset[str]
    marker: Callable[[Path], bool]
    resumable: bool = False


KINDS: dict[str, OutputKind] = {k.name: k for k in (
    OutputKind("run", "a run (mixfleet run)", RUN_ENTRIES,
               lambda p: (_header(p) or {}).get("source") == "runner", resumable=True),
    OutputKind("twin_runlog", "a twin run log (mixfleet simulate)", RUNLOG_ENTRIES,
               lambda p: (_header(p) or {}).get("source") == "twin"),
    OutputKind("checkpoint", "a checkpoint (mixfleet init-model / pretrain)", CHECKPOINT_ENTRIES, _is_checkpoint),
)}


def _entries(path: Path) -> set[str]:
    return {p.name for p in path.iterdir() if not _OUR_TEMP.match(p.name)}


def classify(path: str | os.PathLike[str]) -> str | None:
    """The kind (a KINDS key) of an existing, non-empty folder mixfleet wrote; None if it is not (only) ours."""
    p = Path(path)
    names = _entries(p)
    for kind in KINDS.values():
        if names <= kind.entries and kind.marker(p):
            return kind.name
    return None


def _describe(path: Path, kind: str | None) -> str:
    if kind is None and (path / "run.json").is_file() and _header(path) is None:
        return "its run.json is not a readable mixfleet run-log header (corrupt, or another tool's)"
    if kind is None:
        names = sorted(_entries(path))
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return f"it holds files mixfleet did not write ({shown})"
    h = _header(path)
    run = f" {h.get('run_id')!r}, status {h.get('status')!r}" if h else ""
    return f"it already holds {KINDS[kind].label}{run}"


def prepare_output_dir(path: str | os.PathLike[str], kind: str, *, where: str, flag: str = "--out",
                       resume: bool = False, force: bool = False, clear: bool = True) -> str:
    """Check that `kind` output may be written at `path`; returns "new", "resume" or "replace".

    "new": the path does not exist or is an empty folder. "resume": `resume` and the folder holds the same
    resumable kind. "replace": `force` and the folder holds mixfleet output; when `clear`, the folder is
    removed here (callers that replace it atomically themselves pass clear=False).
    Anything else is a SpecError naming `where` (the command), `flag`, the path and what is allowed.
    """
    if kind not in KINDS:
        raise SpecError("prepare_output_dir", "kind", kind, tuple(KINDS))
    want = KINDS[kind]
    p = Path(path)
    options = ("--resume (continue it) or --force (replace it)" if want.resumable
               else "--force (replace it)")
    if p.exists() and not p.is_dir():
        raise SpecError(where, flag, str(p), "a new or empty folder (this path is a file)")
    if not p.exists() or not _entries(p):
        return "new"
    try:
        found = classify(p)
    except OSError as exc:
        raise SpecError(where, flag, str(p), f"a folder mixfleet can read ({exc})") from None
    if resume:
        if not want.resumable:
            raise SpecError(where, "--resume", str(p), f"only for {KINDS['run'].label}")
        if found == kind:
            return "resume"
        raise SpecError(where, flag, str(p), f"{want.label} to continue with --resume; {_describe(p, found)}")
    if found is None:
        raise SpecError(where, flag, str(p), f"a new or empty folder; {_describe(p, found)} and --force replaces "
                                             "only a folder mixfleet wrote: choose another folder")
    if not force:
        how = options if found == kind else "--force (replace it)"
        raise SpecError(where, flag, str(p), f"a new or empty folder, or pass {how}; {_describe(p, found)}")
    if clear:
        shutil.rmtree(p)
    return "replace"
