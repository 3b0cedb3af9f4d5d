"""The run log: one record format for the simulated (twin) and the real (runner) world.

Both worlds write the same four tables, so the UI, calibration, `mixfleet compare` and
`mixfleet fidelity` read one format:

- `trajectories`: one row per finished (or aborted) episode            -> `TrajectoryRecord`
- `updates`:      one row per trainer update                           -> `UpdateRecord`
- `groups`:       one row per (update, sampler group)                  -> `GroupRecord`
- `events`:       scaling, cold starts, failures, weight pushes, notes -> `EventRecord`

On disk a run log is a folder::

    run.json                      header: run_id, source ("twin" | "runner"), plan, seed, versions, status...
    trajectories/part-000000.parquet
    updates/part-000000.parquet
    groups/...
    events/...

Each table is a Parquet dataset (a folder of part files) that plain `pd.read_parquet(dir / "updates")`
reads. Part files are written atomically (temp file with a leading dot in the same folder, fsync,
rename), so a run killed mid-write still reads up to its last complete part, and pyarrow's dataset
discovery never sees a half-written file (it skips names starting with "." or "_").

Conventions (all worlds): times are seconds since the run's start (simulated seconds for the twin,
wall seconds for the runner; the header's `source` says which). Weight version 0 is the initial
policy; update `v` trains on data sampled with versions <= v-1 and produces version `v`. The
staleness of a token trained in update `v` is `(v - 1) - version that sampled it` (0 = on-policy).
Metrics a world does not produce are NaN (None is accepted and stored as NaN). Missing group /
replica / version in an event are "" / -1 / -1, so every column keeps one dtype.

No torch, no mixfleet imports: this module is part of costmodel/.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, fields
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records import writepoints

FORMAT_NAME = "mixfleet-runlog"
FORMAT_VERSION = 1
HEADER_FILE = "run.json"
TABLES = ("trajectories", "updates", "groups", "events")
SOURCES = ("twin", "runner")
STATUSES = ("running", "finished", "stopped", "failed")   # stopped: ended on request, resumable
FINISH_REASONS = ("done", "max_turns", "no_tool_call_3x", "aborted", "error", "restarted")
EVENT_KINDS = ("scale_up", "scale_down", "cold_start", "ready", "preempt", "crash", "restart",
               "weight_push", "weight_push_failed", "resume", "note", "placed", "node_lost", "shrink",
               "group_lost", "replan", "new_settings")
EXTREME_RATIO_LOW = 0.2     # a token's sampler/trainer probability ratio below this is "extreme low"
EXTREME_RATIO_HIGH = 5.0    # ... above this is "extreme high"

EPISODE_LIST_MAX = 8192    # entries of a trajectory's per-episode list (commands, sandboxes); turn_* lists: turns

FIND_MAX_DEPTH = 6          # RunLog.find: folders below the root it looks into (a study nests runs 3 deep)
FIND_MAX_DIRS = 10_000      # ... and at most this many folders in all

_PART_RE = re.compile(r"^part-(\d{6,})\.parquet$")
_TMP_RE = re.compile(r"^\.part-(\d{6,})\.parquet\.[0-9a-f]+\.tmp$")
_HEADER_TMP_RE = re.compile(r"^\.run\.json\.[0-9a-f]{8}\.tmp$")
_NAN = float("nan")


class RunLogWarning(UserWarning):
    """A part file of a run log could not be read and was skipped."""


def _nan_if_none(obj: Any, names: Iterable[str]) -> None:
    for name in names:
        v = getattr(obj, name)
        if v is None:
            object.__setattr__(obj, name, _NAN)
        elif not isinstance(v, float):
            try:
                object.__setattr__(obj, name, float(v))
            except (TypeError, ValueError):
                raise SpecError(type(obj).__name__, name, v, "a number, NaN or None") from None


def _check_enum(where: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(where, name, value, allowed)


def _check_nonneg(where: str, obj: Any, names: Iterable[str]) -> None:
    for name in names:
        v = getattr(obj, name)
        if not v >= 0:  # also catches NaN
            raise SpecError(where, name, v, "a number >= 0")


# ---- records ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class TrajectoryRecord:
    """One finished (or aborted) episode."""

    TABLE: ClassVar[str] = "trajectories"

    run_id: str
    prompt_id: str                   # the task / prompt; ints are accepted and stored as str
    sample_index: int                # 0..samples_per_prompt-1 within the prompt-group
    group: str                       # sampler group name (plan)
    replica: int                     # replica index within the group (the last one that served it)
    version_start: int               # weight version of the first sampled token
    version_end: int                 # weight version of the last sampled token
    turns: int                       # assistant replies
    prompt_tokens: int               # tokens not sampled: initial prompt + tool outputs (loss mask 0)
    generated_tokens: int            # tokens sampled by the policy (loss mask 1)
    start_s: float                   # run clock, seconds
    end_s: float                     # run clock, seconds
    reward: float                    # NaN if none
    finish_reason: str               # one of FINISH_REASONS
    restarts: int = 0                # times the episode was restarted / re-routed after a replica loss
    tokens_by_version: dict[int, int] | None = None  # weight version -> generated tokens (optional)
    trained_version: int = -1        # the update that trained on it; -1 = unknown / not (yet) used
    tool_calls: int = -1             # replies that called a tool; -1 = not recorded (older logs)
    tool_s: float = _NAN             # seconds in the task's environment (sandbox start, commands, the tests on
                                     # submit); NaN = not recorded (older logs, the twin)
    # Per-episode lists (None = not recorded: older logs, the twin, a task without them). Bounded by the episode:
    # the turn_* lists have exactly `turns` entries, the others at most EPISODE_LIST_MAX.
    turn_tool_s: list[float] | None = None       # per reply: seconds of its tool call (NaN: the reply called none)
    turn_output_tokens: list[int] | None = None  # per reply: tokens appended after it (tool output / nudge; 0: none)
    command_s: list[float] | None = None         # seconds of each sandbox command, in order (the model's commands,
                                                 # a task's setup, the tests on submit)
    sandbox_start_s: list[float] | None = None   # start seconds of each sandbox the episode opened (repo: 2)
    pool_wait_s: list[float] | None = None       # seconds each of them waited for a slot of the sandbox pool

    LISTS: ClassVar[tuple[str, ...]] = ("turn_tool_s", "turn_output_tokens", "command_s", "sandbox_start_s",
                                        "pool_wait_s")
    sandbox_wait_s: float = _NAN     # seconds it waited for a sandbox from the pool (from start_s, before its
                                     # sandbox started); NaN = no sandboxes / not recorded

    def __post_init__(self) -> None:
        where = "TrajectoryRecord"
        if isinstance(self.prompt_id, int):
            object.__setattr__(self, "prompt_id", str(self.prompt_id))
        _check_enum(where, "finish_reason", self.finish_reason, FINISH_REASONS)
        _nan_if_none(self, ("reward", "tool_s", "sandbox_wait_s"))
        for name in self.LISTS:
            v = getattr(self, name)
            if v is None:
                continue
            try:
                vals = [int(x) for x in v] if name == "turn_output_tokens" else [float(x) for x in v]
            except (TypeError, ValueError):
                raise SpecError(where, name, v, "a list of numbers or None") from None
            if len(vals) > EPISODE_LIST_MAX or (name.startswith("turn_") and len(vals) != self.turns):
                raise SpecError(where, name, f"{len(vals)} entries", f"{self.turns} (turns)" if name.startswith(
                    "turn_") else f"at most {EPISODE_LIST_MAX} (EPISODE_LIST_MAX)")
            if not all(x >= 0 or (name == "turn_tool_s" and math.isnan(x)) for x in vals):
                raise SpecError(where, name, v, "numbers >= 0" + (" or NaN" if name == "turn_tool_s" else ""))
            object.__setattr__(self, name, vals)
        _check_nonneg(where, self, ("sample_index", "turns", "prompt_tokens", "generated_tokens", "restarts",
                                    "version_start", "start_s"))
        if self.version_end < self.version_start:
            raise SpecError(where, "version_end", self.version_end, f">= version_start ({self.version_start})")
        if not self.end_s >= self.start_s:
            raise SpecError(where, "end_s", self.end_s, f">= start_s ({self.start_s})")


@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateRecord:
    """One trainer update (optimizer step) producing weight version `version`."""

    TABLE: ClassVar[str] = "updates"
    METRICS: ClassVar[tuple[str, ...]] = (
        "kl_k1", "kl_k3", "masked_share", "extreme_share", "extreme_low_share", "extreme_high_share", "ess", "entropy",
        "grad_norm", "loss", "reward_mean", "pass_at_k", "tool_s")

    version: int                     # weight version this update produced (1, 2, ...)
    start_s: float                   # run clock when the batch was ready and training started
    end_s: float                     # run clock when the new weights were pushed (update done)
    train_step_s: float              # seconds of trainer compute (forward/backward/optimizer)
    weight_sync_s: float             # seconds exporting + pushing weights to the samplers
    tokens: int                      # generated (loss-mask 1) tokens trained on
    trajectories: int                # trajectories in the batch
    staleness_mean: float            # per-token staleness in versions (0 = on-policy)
    staleness_p50: float
    staleness_p95: float
    staleness_max: float
    cost_sampler_usd: float          # cumulative sampler cost at end_s, USD
    cost_trainer_usd: float          # cumulative trainer cost at end_s, USD
    # trainer metrics (CORRECTIONS.md); NaN when a world does not produce them
    kl_k1: float = _NAN              # mean log(p_sampler / p_trainer) over trained tokens
    kl_k3: float = _NAN              # mean (r - 1 - log r), r = p_trainer / p_sampler
    masked_share: float = _NAN       # share of trained tokens the correction masked
    extreme_share: float = _NAN      # share of tokens with ratio outside [EXTREME_RATIO_LOW, EXTREME_RATIO_HIGH]
    extreme_low_share: float = _NAN  # its part with ratio < EXTREME_RATIO_LOW (NaN where the split is unknown)
    extreme_high_share: float = _NAN  # its part with ratio > EXTREME_RATIO_HIGH (NaN where the split is unknown)
    ess: float = _NAN                # effective sample size of the importance weights, as a share (0..1]
    entropy: float = _NAN            # mean per-token entropy of the trainer policy, nats
    grad_norm: float = _NAN
    loss: float = _NAN
    reward_mean: float = _NAN        # mean reward of the batch
    pass_at_k: float = _NAN          # held-out evaluation (only on eval updates)
    tool_s: float = _NAN             # seconds the batch's episodes spent in their tools (sandbox start, commands,
                                     # submission tests), summed; NaN where not recorded (older logs, the twin)
    cost_sandbox_usd: float = 0.0    # cumulative sandbox cost at end_s, USD (live sandboxes, starting included)
    sandbox_wait_s: float = _NAN     # seconds the batch's episodes waited for a sandbox from the pool, summed
    sandbox_s: float = _NAN          # sandbox-seconds the batch's episodes held (start + turns + commands), summed;
                                     # both NaN without sandboxes. Pool wait share: wait / (wait + held)

    def __post_init__(self) -> None:
        where = "UpdateRecord"
        _nan_if_none(self, ("staleness_mean", "staleness_p50", "staleness_p95", "staleness_max", "sandbox_wait_s",
                            "sandbox_s") + self.METRICS)
        if self.cost_sandbox_usd is None:
            object.__setattr__(self, "cost_sandbox_usd", 0.0)
        _check_nonneg(where, self, ("version", "start_s", "train_step_s", "weight_sync_s", "tokens", "trajectories",
                                    "cost_sampler_usd", "cost_trainer_usd", "cost_sandbox_usd"))
        if not self.end_s >= self.start_s:
            raise SpecError(where, "end_s", self.end_s, f">= start_s ({self.start_s})")


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupRecord:
    """One sampler group during one update: the window (previous update's end_s, this end_s]."""

    TABLE: ClassVar[str] = "groups"

    version: int                     # the update (UpdateRecord.version) this row belongs to
    group: str
    replicas_up: float               # mean replicas serving over the window (time-weighted)
    utilization: float               # share of the up replicas' time spent generating, 0..1
    tokens_generated: int            # tokens this group sampled during the window
    samples: int                     # trajectories of this group in the update's batch
    share_of_samples: float          # samples / batch trajectories, 0..1
    kl_k3: float = _NAN              # trainer metrics over this group's tokens in the batch
    extreme_share: float = _NAN      # share of its tokens with ratio outside [0.2, 5]
    cost_usd: float = 0.0            # this group's cost during the window, USD (not cumulative)
    kl_k1: float = _NAN
    masked_share: float = _NAN
    staleness_mean: float = _NAN     # per-token staleness of its samples in the batch, versions
    tokens_trained: int = 0          # generated tokens of its samples in the batch
    # MoE routing disagreement over its trained tokens (sampler's recorded top-k experts vs the trainer's):
    routing_token_share: float = _NAN   # share of tokens whose expert set differs in >= 1 layer, 0..1
    routing_layer_share: float = _NAN   # mean share of layers whose expert set differs, 0..1
    kl_k3_on_policy: float = _NAN    # k3 / k1 over its staleness-0 tokens only: the precision mismatch alone
    kl_k1_on_policy: float = _NAN
    tokens_on_policy: int = 0        # its staleness-0 tokens in the batch

    def __post_init__(self) -> None:
        where = "GroupRecord"
        _nan_if_none(self, ("kl_k3", "extreme_share", "kl_k1", "masked_share", "staleness_mean",
                            "routing_token_share", "routing_layer_share", "kl_k3_on_policy", "kl_k1_on_policy"))
        _check_nonneg(where, self, ("version", "replicas_up", "utilization", "tokens_generated", "samples",
                                    "share_of_samples", "cost_usd", "tokens_trained", "tokens_on_policy"))


@dataclass(frozen=True, kw_only=True, slots=True)
class EventRecord:
    """Something that happened to the fleet or the trainer."""

    TABLE: ClassVar[str] = "events"

    time_s: float                    # run clock, seconds
    kind: str                        # one of EVENT_KINDS
    group: str = ""                  # "" when not about a group
    replica: int = -1                # -1 when not about one replica
    version: int = -1                # weight version involved (weight_push...), -1 if none
    detail: str = ""                 # free text or JSON
    duration_s: float = _NAN         # e.g. cold start or push time, seconds

    def __post_init__(self) -> None:
        _check_enum("EventRecord", "kind", self.kind, EVENT_KINDS)
        _nan_if_none(self, ("duration_s",))
        if self.group is None:
            object.__setattr__(self, "group", "")
        if self.replica is None:
            object.__setattr__(self, "replica", -1)
        if self.version is None:
            object.__setattr__(self, "version", -1)


Record = TrajectoryRecord | UpdateRecord | GroupRecord | EventRecord
RECORD_TYPES: dict[str, type] = {r.TABLE: r for r in (TrajectoryRecord, UpdateRecord, GroupRecord, EventRecord)}

# ---- schemas ------------------------------------------------------------------------------------
_ARROW_TYPES = {"str": pa.string(), "int": pa.int64(), "float": pa.float64()}


def _schema_for(cls: type) -> pa.Schema:
    cols = []
    for f in fields(cls):
        t = f.type if isinstance(f.type, str) else f.type.__name__
        if t.startswith("dict[int, int]"):
            cols.append(pa.field(f.name, pa.map_(pa.int64(), pa.int64()), nullable=True))
        elif t.startswith(("list[float]", "list[int]")):
            item = pa.float64() if t.startswith("list[float]") else pa.int64()
            cols.append(pa.field(f.name, pa.list_(item), nullable=True))
        else:
            cols.append(pa.field(f.name, _ARROW_TYPES[t], nullable=False))
    return pa.schema(cols)


SCHEMAS: dict[str, pa.Schema] = {name: _schema_for(cls) for name, cls in RECORD_TYPES.items()}


def empty_frame(table: str) -> pd.DataFrame:
    """An empty DataFrame with the table's columns and dtypes."""
    return _to_pandas(SCHEMAS[table].empty_table(), table)


def _to_pandas(t: pa.Table, table: str) -> pd.DataFrame:
    df = t.to_pandas()
    if table == "trajectories" and "tokens_by_version" in df.columns:
        df["tokens_by_version"] = [None if v is None else dict(v) for v in df["tokens_by_version"]]
    if table == "trajectories":
        for name in TrajectoryRecord.LISTS:
            if name in df.columns:
                df[name] = [None if v is None else (v.tolist() if hasattr(v, "tolist") else list(v))
                            for v in df[name]]
    return df


def records_frame(table: str, records: Iterable[Any]) -> pd.DataFrame:
    """Records of one table as the DataFrame `RunLog` reads for it (same columns and dtypes), without a file:
    what a policy reading a run as it goes fits on (`costmodel.calibration.logs.FrameLog`)."""
    if table not in SCHEMAS:
        raise SpecError("records_frame", "table", table, TABLES)
    return _to_pandas(_records_to_table(table, list(records)), table)


def _records_to_table(table: str, records: list[Any]) -> pa.Table:
    schema = SCHEMAS[table]
    cols = {}
    for f in schema:
        vals = [getattr(r, f.name) for r in records]
        if pa.types.is_map(f.type):
            vals = [None if v is None else list(v.items()) for v in vals]
        cols[f.name] = pa.array(vals, type=f.type)
    return pa.Table.from_pydict(cols, schema=schema)


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


def _part_numbers(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _PART_RE.match(p.name)))


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


# ---- reader -----------------------------------------------------------------------------------
def _read_header(path: Path) -> dict[str, Any]:
    try:
        h = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(str(path), "run.json", str(exc), "a readable JSON object") from None
    if not isinstance(h, dict):
        raise SpecError(str(path), "run.json", type(h).__name__, "a JSON object")
    return h


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
