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

This module holds the records, their Arrow schemas and `records_frame`; the writer (`RunLogWriter`,
`plan_changes`) is runlog_writer.py and the reader (`RunLog`, `extreme_shares`) runlog_reader.py, both
re-exported here, so `from mixfleet.costmodel.records.runlog import RunLog, RunLogWriter` keeps working.

No torch, no mixfleet imports: this module is part of costmodel/.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd
import pyarrow as pa
from mixfleet.costmodel.errors import SpecError

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
                                     # submit; the twin: its tool latencies + sandbox wait and start); NaN = not
                                     # recorded (older logs, a twin session begun before the run or restarted)
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


# ---- shared by the writer and the reader ----------------------------------------------------------
def _part_numbers(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := _PART_RE.match(p.name)))


def _read_header(path: Path) -> dict[str, Any]:
    try:
        h = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(str(path), "run.json", str(exc), "a readable JSON object") from None
    if not isinstance(h, dict):
        raise SpecError(str(path), "run.json", type(h).__name__, "a JSON object")
    return h


# ---- the writer and the reader: their own modules -------------------------------------------------
# re-exported: the run log's public API, docs/runlog.md (on first use: runlog_writer / runlog_reader import this module)
_MOVED = {"RunLogWriter": "runlog_writer", "plan_changes": "runlog_writer",
          "RunLog": "runlog_reader", "extreme_shares": "runlog_reader"}

if TYPE_CHECKING:
    from mixfleet.costmodel.records.runlog_reader import RunLog, extreme_shares  # noqa: F401
    from mixfleet.costmodel.records.runlog_writer import RunLogWriter, plan_changes  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(import_module(f"{__package__}.{_MOVED[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
