"""The run log's reader: `RunLog` reads a run-log folder (its header and the four tables as DataFrames, only
complete part files, unreadable ones skipped with a warning; `refresh()` follows a live run), finds run logs
under a folder, and `extreme_shares` reads the updates' extreme-ratio share across format versions. The
record types, schemas and file layout are costmodel/records/runlog.py (which re-exports `RunLog` and
`extreme_shares`); the writer is costmodel/records/runlog_writer.py. docs/runlog.md.

No torch, no mixfleet imports but costmodel's: this module is part of costmodel/.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import (
    _NAN,
    FIND_MAX_DEPTH,
    FIND_MAX_DIRS,
    FORMAT_NAME,
    HEADER_FILE,
    RECORD_TYPES,
    SCHEMAS,
    TABLES,
    RunLogWarning,
    _part_numbers,
    _read_header,
    _to_pandas,
    empty_frame,
)


class RunLog:
    """A run log read from disk: `.header` (dict) and the four tables as pandas DataFrames.

    Only complete part files (`part-NNNNNN.parquet`) are read, in part order; temp files are ignored and
    unreadable parts are skipped with a `RunLogWarning`. Every table has all its columns, even when empty.
    `refresh()` reads parts written since (to follow a live run).
    """

    def __init__(self, directory: Path, header: dict[str, Any]) -> None:
        self.directory = directory
        self.header = header
        self._seen: dict[str, set[str]] = {t: set() for t in TABLES}
        self._frames: dict[str, pd.DataFrame] = {t: empty_frame(t) for t in TABLES}
        self.skipped: list[Path] = []
        self.skip_reasons: dict[Path, str] = {}      # why each skipped part was not read

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> RunLog:
        d = Path(directory)
        if not (d / HEADER_FILE).is_file():
            raise SpecError("RunLog.open", "directory", str(d), f"a run-log folder containing {HEADER_FILE}")
        log = cls(d, _read_header(d / HEADER_FILE))
        log.refresh()
        return log

    @staticmethod
    def is_run_log(path: str | os.PathLike[str]) -> bool:
        """True if `path` is a folder with a run.json header written by RunLogWriter."""
        return RunLog.not_a_run_log(path) is None

    @staticmethod
    def not_a_run_log(path: str | os.PathLike[str]) -> str | None:
        """Why `path` is not a run log ("no run.json", "run.json is not valid JSON (...)", ...), None if it is."""
        p = Path(path) / HEADER_FILE
        if not p.is_file():
            return f"no {HEADER_FILE}"
        try:
            h = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return f"{HEADER_FILE} is unreadable or not valid JSON ({exc})"
        if not isinstance(h, dict) or h.get("format") != FORMAT_NAME:
            return f"{HEADER_FILE} is not a mixfleet run-log header (no format {FORMAT_NAME!r})"
        return None

    @staticmethod
    def find(root: str | os.PathLike[str], *, max_depth: int = FIND_MAX_DEPTH,
             max_dirs: int = FIND_MAX_DIRS) -> list[Path]:
        """Run-log folders at or under `root` (sorted; does not descend into a run log nor follow links), at most
        `max_depth` folders below `root`, looking into at most `max_dirs` folders (a typed "/" stays cheap)."""
        root = Path(root)
        found: list[Path] = []
        if not root.is_dir():
            return found
        if RunLog.is_run_log(root):
            return [root]
        seen = 0
        for dirpath, dirnames, _ in os.walk(root):
            seen += 1
            if seen > max_dirs:
                break
            dirnames.sort()
            here = Path(dirpath)
            if len(here.relative_to(root).parts) >= max_depth:
                dirnames[:] = []
                continue
            keep = []
            for name in dirnames:
                if name.startswith(".") or (here / name).is_symlink():    # a link may point anywhere: not followed
                    continue
                if RunLog.is_run_log(here / name):
                    found.append(here / name)
                else:
                    keep.append(name)
            dirnames[:] = keep
        return sorted(found)

    def refresh(self) -> RunLog:
        """Re-read run.json and read part files not read yet."""
        hp = self.directory / HEADER_FILE
        if hp.is_file():
            try:
                self.header = _read_header(hp)
            except SpecError as exc:
                warnings.warn(f"run log {self.directory}: keeping the old header: {exc}", RunLogWarning,
                              stacklevel=2)
        for t in TABLES:
            folder = self.directory / t
            new = [n for n in _part_numbers(folder) if f"part-{n:06d}.parquet" not in self._seen[t]]
            parts = [self._frames[t]] if len(self._frames[t]) else []
            for n in new:
                path = folder / f"part-{n:06d}.parquet"
                try:
                    frame = _to_pandas(_conform(pq.read_table(path), t), t)
                except (pa.ArrowException, OSError, SpecError) as exc:  # cut, corrupt or another table's schema
                    warnings.warn(f"run log {self.directory}: skipping unreadable part {t}/{path.name}: {exc}",
                                  RunLogWarning, stacklevel=2)
                    self.skipped.append(path)
                    self.skip_reasons[path] = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
                    self._seen[t].add(path.name)  # warn once, not on every refresh
                    continue
                self._seen[t].add(path.name)
                parts.append(frame)
            if parts and (new or not len(self._frames[t])):
                frame = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
                self._frames[t] = frame.reset_index(drop=True)
        return self

    def table(self, name: str) -> pd.DataFrame:
        if name not in TABLES:
            raise SpecError("RunLog.table", "name", name, TABLES)
        return self._frames[name]

    @property
    def trajectories(self) -> pd.DataFrame:
        return self._frames["trajectories"]

    @property
    def updates(self) -> pd.DataFrame:
        return self._frames["updates"]

    @property
    def groups(self) -> pd.DataFrame:
        return self._frames["groups"]

    @property
    def events(self) -> pd.DataFrame:
        return self._frames["events"]

    @property
    def run_id(self) -> str:
        return str(self.header.get("run_id", self.directory.name))

    @property
    def source(self) -> str:
        return str(self.header.get("source", ""))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{t}={len(self._frames[t])}" for t in TABLES)
        return f"RunLog({str(self.directory)!r}, run_id={self.run_id!r}, source={self.source!r}, {sizes})"


def extreme_shares(updates: pd.DataFrame) -> pd.Series:
    """`updates.extreme_share` (tokens with ratio outside [0.2, 5]); for rows written before that column
    existed (NaN there), `extreme_low_share + extreme_high_share`."""
    total = updates["extreme_share"]
    return total.where(total.notna(), updates["extreme_low_share"] + updates["extreme_high_share"])


def _conform(data: pa.Table, table: str) -> pa.Table:
    """Cast a part to the current schema: missing columns (older format) become defaults, extras are kept.
    A part without the record's required columns (those without a default, in every format version) or
    whose columns do not cast is not a part of this table: SpecError / ArrowException."""
    schema = SCHEMAS[table]
    required = [f.name for f in fields(RECORD_TYPES[table]) if f.default is MISSING]
    missing = [n for n in required if n not in data.column_names]
    if missing:
        raise SpecError(f"{table} part", "columns", sorted(data.column_names)[:8],
                        f"the {table} table's columns (missing {', '.join(missing[:5])})")
    cols, names = [], []
    for f in schema:
        if f.name in data.column_names:
            col = data.column(f.name)
            cols.append(col if col.type == f.type else col.cast(f.type))
        else:
            default = _default_for(table, f.name)
            cols.append(pa.array([default] * data.num_rows, type=f.type))
        names.append(f.name)
    for name in data.column_names:
        if name not in names:
            cols.append(data.column(name))
            names.append(name)
    return pa.Table.from_arrays(cols, names=names)


def _default_for(table: str, name: str) -> Any:
    for f in fields(RECORD_TYPES[table]):
        if f.name == name:
            if f.default is not MISSING and not (isinstance(f.default, float) and math.isnan(f.default)):
                return f.default
            return {"str": "", "int": -1, "float": _NAN}.get(str(f.type), None)
    return None
