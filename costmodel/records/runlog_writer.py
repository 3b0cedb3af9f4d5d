"""The run log's writer: `RunLogWriter` appends records to a run-log folder as atomic Parquet part files and
keeps its `run.json` header (create, resume, status), with `plan_changes`, the plan comparison a resume is
checked with. The record types, schemas and file layout are costmodel/records/runlog.py (which re-exports
`RunLogWriter` and `plan_changes`); the reader is costmodel/records/runlog_reader.py. docs/runlog.md.

No torch, no mixfleet imports but costmodel's: this module is part of costmodel/.
"""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records import writepoints
from mixfleet.costmodel.records.runlog import (
    _HEADER_TMP_RE,
    _TMP_RE,
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_FILE,
    RECORD_TYPES,
    SOURCES,
    STATUSES,
    TABLES,
    Record,
    _check_enum,
    _part_numbers,
    _read_header,
    _records_to_table,
)


# ---- atomic file helpers ---------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, obj: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=False, default=str)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _software_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("mixfleet", "torch", "megatron-core", "torchao", "simpy", "numpy", "pandas", "pyarrow", "ray"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _now_utc() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _flat(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flat(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif (isinstance(value, list) and value and all(isinstance(v, Mapping) and "name" in v for v in value)
          and len({str(v["name"]) for v in value}) == len(value)):
        for v in value:                       # [[groups]]: by name, so a reordering is no difference
            _flat({k: x for k, x in v.items() if k != "name"}, f"{prefix}.{v['name']}", out)
            out.setdefault(f"{prefix}.{v['name']}", "<present>")
    else:
        out[prefix] = value
    return out


def plan_changes(recorded: Any, given: Any, *, ignore: Iterable[str] = ("description",)) -> dict[str, list[Any]]:
    """The dotted fields where two plan tables (as a header holds them) differ: {field: [old, new]}, "<absent>"
    for a field one of them lacks (groups keyed by name; fields in `ignore` are not compared). Empty when they
    are the same plan."""
    def plain(x: Any) -> dict[str, Any]:
        d = json.loads(json.dumps(x if isinstance(x, Mapping) else {}, default=str))
        return _flat({k: v for k, v in d.items() if k not in set(ignore)}, "", {})

    a, b = plain(recorded), plain(given)
    return {k: [a.get(k, "<absent>"), b.get(k, "<absent>")]
            for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")}


# ---- writer -----------------------------------------------------------------------------------
class RunLogWriter:
    """Appends records to a run-log folder; one Parquet part file per table per flush.

    `RunLogWriter(directory, header)` creates the folder and `run.json`, or reopens an existing run log
    (resume): the header is updated with the given keys, `resumes` is incremented, part numbering
    continues after the highest existing part, old parts are kept and leftover temp files are removed. A resume
    with another plan is refused, but for the dotted fields in `taken` (run settings a resume took, checked by
    the caller: runner/orchestration/resume.py `prepare_resume`).
    Rows are buffered and flushed every `flush_every_rows` rows (in any one table) or `flush_every_s`
    wall seconds (checked on append; None disables either), on `flush()` and on `close()`.
    Use as a context manager: a clean exit sets status "finished", an exception sets "failed".
    One writer per run log at a time.
    """

    def __init__(self, directory: str | os.PathLike[str], header: Mapping[str, Any] | None = None, *,
                 flush_every_rows: int | None = 10_000, flush_every_s: float | None = 10.0,
                 taken: Iterable[str] = ()) -> None:
        if flush_every_rows is not None and flush_every_rows < 1:
            raise SpecError("RunLogWriter", "flush_every_rows", flush_every_rows, "an integer >= 1 or None")
        if flush_every_s is not None and not flush_every_s > 0:
            raise SpecError("RunLogWriter", "flush_every_s", flush_every_s, "seconds > 0 or None")
        self.directory = Path(directory)
        self.flush_every_rows = flush_every_rows
        self.flush_every_s = flush_every_s
        self._buffers: dict[str, list[Any]] = {t: [] for t in TABLES}
        self._observers: list[Callable[[Record], Iterable[Record]]] = []
        self._closed = False
        given = dict(header or {})
        header_path = self.directory / HEADER_FILE
        if header_path.exists():
            old = _read_header(header_path)
            if "source" in given and given["source"] != old.get("source"):
                raise SpecError("RunLogWriter header", "source", given["source"],
                                f"the existing log's source ({old.get('source')!r}) when resuming")
            if "run_id" in given and given["run_id"] != old.get("run_id"):
                raise SpecError("RunLogWriter header", "run_id", given["run_id"],
                                f"the existing log's run_id ({old.get('run_id')!r}) when resuming")
            changed = plan_changes(old.get("plan"), given.get("plan"))
            diff = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items() if k not in set(taken)]
            if "plan" in given and diff:
                more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
                raise SpecError("RunLogWriter header", "plan", (given["plan"] or {}).get("name"),
                                f"the plan the log in {self.directory} was started with, to resume it (it differs: "
                                f"{'; '.join(diff[:4])}{more})")
            self.header = {**old, **given, "status": "running", "resumes": int(old.get("resumes", 0)) + 1,
                           "resumed_utc": _now_utc()}
        else:
            source = given.pop("source", None)
            _check_enum("RunLogWriter header", "source", source, SOURCES)
            plan = given.pop("plan", {})
            if not isinstance(plan, Mapping):
                raise SpecError("RunLogWriter header", "plan", plan, "a dict")
            self.header = {
                "format": FORMAT_NAME, "format_version": FORMAT_VERSION,
                "run_id": str(given.pop("run_id", None) or f"{self.directory.name}-{uuid.uuid4().hex[:8]}"),
                "source": source, "plan": dict(plan), "seed": given.pop("seed", None),
                "versions": {**_software_versions(), **dict(given.pop("versions", {}))},
                "created_utc": _now_utc(), "status": "running", "resumes": 0,
                **given,
            }
        self._validate_header(self.header)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._next_part: dict[str, int] = {}
        for t in TABLES:
            folder = self.directory / t
            folder.mkdir(exist_ok=True)
            for p in folder.iterdir():  # temp files of a killed writer
                if _TMP_RE.match(p.name):
                    p.unlink(missing_ok=True)
            nums = _part_numbers(folder)
            self._next_part[t] = nums[-1] + 1 if nums else 0
        for p in self.directory.iterdir():      # a killed header write's temp file
            if _HEADER_TMP_RE.match(p.name) and p.is_file():
                p.unlink(missing_ok=True)
        _write_json_atomic(header_path, self.header)
        self._last_flush = time.monotonic()

    @staticmethod
    def _validate_header(h: Mapping[str, Any]) -> None:
        _check_enum("run.json", "source", h.get("source"), SOURCES)
        _check_enum("run.json", "status", h.get("status"), STATUSES)
        try:
            json.dumps(dict(h))
        except (TypeError, ValueError) as exc:
            raise SpecError("run.json", "header", str(exc), "JSON-serializable values") from None

    @property
    def run_id(self) -> str:
        return str(self.header["run_id"])

    def append(self, record: Record) -> None:
        """Buffer one record (any of the four types); may trigger an automatic flush."""
        if self._closed:
            raise RuntimeError(f"run log {self.directory} is closed")
        table = getattr(type(record), "TABLE", None)
        if table not in RECORD_TYPES or not isinstance(record, RECORD_TYPES[table]):
            raise SpecError("RunLogWriter.append", "record", type(record).__name__,
                            [c.__name__ for c in RECORD_TYPES.values()])
        buf = self._buffers[table]
        buf.append(record)
        for observe in self._observers:   # e.g. the `replan` autoscaler: its decisions come back as records
            for extra in observe(record):
                self.append(extra)
        if (self.flush_every_rows is not None and len(buf) >= self.flush_every_rows) or (
                self.flush_every_s is not None and time.monotonic() - self._last_flush >= self.flush_every_s):
            self.flush()

    def extend(self, records: Iterable[Record]) -> None:
        for r in records:
            self.append(r)

    def observe(self, observer: Callable[[Record], Iterable[Record]]) -> None:
        """Hand every record appended from now on to `observer` too; the records it returns are appended after
        it (the way a policy that reads the run as it goes, `policies.replan`, logs its own decisions)."""
        self._observers.append(observer)

    def pending(self) -> dict[str, int]:
        """Buffered (not yet written) rows per table."""
        return {t: len(b) for t, b in self._buffers.items()}

    def flush(self) -> dict[str, Path]:
        """Write each table's buffered rows as one new part file (atomically). Returns the files written."""
        written: dict[str, Path] = {}
        for t in TABLES:
            buf = self._buffers[t]
            if not buf:
                continue
            written[t] = self._write_part(t, _records_to_table(t, buf))
            self._buffers[t] = []
        self._last_flush = time.monotonic()
        return written

    def _write_part(self, table: str, data: pa.Table) -> Path:
        folder = self.directory / table
        n = self._next_part[table]
        final = folder / f"part-{n:06d}.parquet"
        tmp = folder / f".part-{n:06d}.parquet.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as fh:
            pq.write_table(data, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(folder)
        self._next_part[table] = n + 1
        writepoints.reached(f"part:{table}")
        return final

    def update_header(self, **kw: Any) -> None:
        """Merge keys into run.json and rewrite it atomically (e.g. status="finished", wall_s=12.3)."""
        new = {**self.header, **kw}
        self._validate_header(new)
        _write_json_atomic(self.directory / HEADER_FILE, new)
        self.header = new

    def truncate_after_version(self, version: int, tables: Iterable[str] = ("updates", "groups")) -> int:
        """Drop already-written rows of `tables` whose weight version is > `version` (for a resume from the
        checkpoint of `version`, so the replayed updates are not duplicated). Trajectories are filtered by
        `trained_version` (the update that trained them; never-trained rows, -1, stay), events by `version`.
        Each affected part is rewritten atomically (deleted if emptied).
        Buffered rows are flushed first. Returns the number of rows dropped."""
        self.flush()
        key = {"trajectories": "trained_version", "updates": "version", "groups": "version", "events": "version"}
        dropped = 0
        for t in tables:
            if t not in TABLES:
                raise SpecError("truncate_after_version", "tables", t, TABLES)
            folder = self.directory / t
            for n in _part_numbers(folder):
                path = folder / f"part-{n:06d}.parquet"
                try:
                    data = pq.read_table(path)
                    col = data.column(key[t]).cast(pa.int64()).to_pylist()
                except (pa.ArrowException, OSError, KeyError):
                    continue                        # a part the reader skips too (cut, or another schema)
                keep = [i for i, v in enumerate(col) if v <= version]
                if len(keep) == len(col):
                    continue
                dropped += len(col) - len(keep)
                if not keep:
                    path.unlink()
                else:
                    tmp = folder / f".part-{n:06d}.parquet.{uuid.uuid4().hex[:8]}.tmp"
                    with open(tmp, "wb") as fh:
                        pq.write_table(data.take(keep), fh)
                        fh.flush()
                        os.fsync(fh.fileno())
                    os.replace(tmp, path)
                _fsync_dir(folder)
        return dropped

    def close(self, status: str | None = "finished") -> None:
        """Flush and (unless status is None) set the header's status."""
        if self._closed:
            return
        self.flush()
        if status is not None:
            self.update_header(status=status, closed_utc=_now_utc())
        self._closed = True

    def __enter__(self) -> RunLogWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("failed" if exc_type is not None else "finished")

