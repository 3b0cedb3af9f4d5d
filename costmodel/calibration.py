"""Calibration: fit the cost model's free parameters to run logs, so the twin predicts what really happens.

The twin's numbers come from a roofline with prior efficiency factors (roofline.py) and mismatch priors
(mismatch.py). A run log (runlog.py; real or simulated) holds what happened: per trajectory its group,
replica, turns, tokens and [start, end]; per update the train and sync seconds; per group and update the
measured KL and extreme-ratio share with the staleness. `calibrate(runlogs)` fits, by bounded least
squares (scipy.optimize.least_squares), per group (accelerator, precision, KV dtype, kernel):

- decode_scale (x): multiplier on the prior roofline's decode-step time and prefill compute (1 = prior);
- prefill_overhead_s (s): fixed seconds per prefill call (a turn's admission), before emulation slowdown;
- weight_sync_s (s): trainer-blocking seconds to push a version to the group (per-group push events plus
  the export time shared by all groups: update.weight_sync_s - slowest push);
- kl_k3 and its growth per version of staleness, extreme-ratio share and its growth (kl = kl0 (1 + g s));

and shared: turn_latency_s (seconds between a reply and the next request: tools, HTTP, agent), the
trainer's scale on its roofline compute time and its fixed overhead per update, and update_overhead_s
(seconds between an update's end and the next start that no missing batch explains: checkpointing,
logging). It also measures the workload (turns, prompt / reply / tool-output tokens) as empirical
distributions, so a fidelity check simulates the workload that really ran.

The duration model of a trajectory i on replica r (processor sharing with serial prefill, as the twin):

    dur_i = decode_scale * (tokens_i / <1/step(n(t), L(t))>_i + prefill_compute_i)
            + prefill_overhead_s * slowdown * prefill_calls_i + turn_latency_s * (turns_i - 1)

where step is the prior decode step at the replica's concurrency n(t) (trajectories of r active at t)
and their mean context L(t); <.>_i is the time average over [start_i, end_i]; prefill_compute_i and
prefill_calls_i are the prior prefill seconds and the prefill calls of every trajectory of r spread
evenly over its own life, integrated over i's life. It is linear in the three parameters; residuals are
relative. Uncertainties: covariance = s^2 (J^T J)^-1 with s^2 = sum(r^2) / (m - p); a parameter whose
data do not vary enough to identify it is fixed at its prior and marked `fitted = false`.

Pure numpy / scipy / pandas (no simpy, no torch): costmodel imports nothing of ours outside costmodel.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from mixfleet.costmodel.catalog import Catalog, load_catalog
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.mismatch import mismatch_prior
from mixfleet.costmodel.model import ModelSpec, load_model_spec
from mixfleet.costmodel.planspec import GroupPlan, PlanData, group_replica_model, plan_data_from_dict, running_cap
from mixfleet.costmodel.roofline import Efficiency, ReplicaModel, trainer_step_s
from mixfleet.costmodel.roofline import weight_sync_s as prior_sync
from mixfleet.costmodel.runlog import RunLog, RunLogWarning
from mixfleet.costmodel.tomlread import read_toml
from mixfleet.costmodel.workload import WorkloadSpec, load_workload, workload_from_dict

SCHEMA = 1
MIN_UPDATES = 2                    # the trainer fit and a time per update need two updates
MIN_TRAJECTORIES_PER_GROUP = 10    # the duration fit of a group
MIN_REL_SPREAD = 0.02              # a regressor varying less than this (cv) cannot separate two parameters
MIN_STALENESS_SPREAD = 0.25        # versions: below this, growth with staleness is not identifiable
DURATION_RESIDUALS = "relative"    # "relative" (each trajectory counts alike) | "absolute" (long ones count more)
MAX_GROWTH_PER_VERSION = 10.0      # cap on a mismatch's relative growth per version of staleness
EMPIRICAL_MAX_VALUES = 512         # workload distributions keep at most this many values
SESSION_ITERATIONS = 3             # refits of the duration model (its concurrency uses the fitted turn latency)


class CalibrationWarning(UserWarning):
    """Part of a run log was left out of the fit (an unreadable part file, a segment it cannot use): the
    message says which and why; `Calibration.skipped` keeps the list."""


class CalibrationError(SpecError):
    """Too little data to fit: the message lists what is missing."""

    def __init__(self, missing: Sequence[str]) -> None:
        self.missing = list(missing)
        ValueError.__init__(self, "cannot calibrate from these run logs; missing: " + "; ".join(self.missing))
        self.where, self.field, self.value, self.allowed = "calibration", "run logs", len(self.missing), ""

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True, kw_only=True)
class Fitted:
    """One fitted value: value +- stderr (1 sigma), the prior it replaces, and whether the data identified it."""
    value: float
    stderr: float = math.nan
    prior: float = math.nan
    unit: str = ""
    fitted: bool = True              # False: kept at the prior (the note says why)
    note: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.value, int | float) or isinstance(self.value, bool) or not math.isfinite(self.value):
            raise SpecError("calibration value", "value", self.value, "a finite number")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"value": float(self.value), "fitted": self.fitted}
        for k in ("stderr", "prior"):
            v = float(getattr(self, k))
            if math.isfinite(v):
                d[k] = v
        if self.unit:
            d["unit"] = self.unit
        if self.note:
            d["note"] = self.note
        return d

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> Fitted:
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return cls(value=float(raw))
        if not isinstance(raw, dict) or "value" not in raw:
            raise SpecError(where, "<value>", raw, "a number or a table with value (stderr, prior, fitted, unit, note)")
        known = ("value", "stderr", "prior", "unit", "fitted", "note")
        for k in raw:
            if k not in known:
                raise SpecError(where, k, raw[k], "one of " + ", ".join(known))
        return cls(value=float(raw["value"]), stderr=float(raw.get("stderr", math.nan)),
                   prior=float(raw.get("prior", math.nan)), unit=str(raw.get("unit", "")),
                   fitted=bool(raw.get("fitted", True)), note=str(raw.get("note", "")))

    def fmt(self, spec: str = ".4g") -> str:
        err = f" +- {self.stderr:{spec}}" if math.isfinite(self.stderr) else ""
        return f"{self.value:{spec}}{err}{(' ' + self.unit) if self.unit else ''}"


GROUP_PARAMS = ("decode_scale", "prefill_overhead_s", "weight_sync_s", "kl_k3", "kl_growth_per_staleness",
                "extreme_share", "extreme_growth_per_staleness")


@dataclass(frozen=True, kw_only=True)
class GroupCalibration:
    """The fitted values of one sampler group (matched to a plan's group by name, else by its key)."""
    name: str
    accelerator: str
    precision: str
    kv_dtype: str
    kernel: str = ""
    decode_scale: Fitted
    prefill_overhead_s: Fitted
    weight_sync_s: Fitted
    kl_k3: Fitted
    kl_growth_per_staleness: Fitted
    extreme_share: Fitted
    extreme_growth_per_staleness: Fitted
    trajectories: int = 0
    residual_rel_rms: float = math.nan   # the duration fit's relative RMS residual for this group

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.accelerator, self.precision, self.kv_dtype, self.kernel)

    def apply(self, rm: ReplicaModel) -> ReplicaModel:
        """The prior replica model with these fitted values: decode step x decode_scale (efficiencies / scale,
        decode overhead x scale), prefill = scale x roofline + fitted overhead."""
        f = self.decode_scale.value
        return replace(rm, eff_bw=rm.eff_bw / f, eff_flops=rm.eff_flops / f,
                       decode_overhead_s=rm.decode_overhead_s * f, prefill_overhead_s=self.prefill_overhead_s.value)

    def efficiency(self, rm: ReplicaModel) -> Efficiency:
        """The same as an `Efficiency` override for `replica_model(...)` (validated: may refuse an extreme fit)."""
        c = self.apply(rm)
        return Efficiency(eff_bw=c.eff_bw, eff_flops=c.eff_flops, decode_overhead_s=c.decode_overhead_s,
                          prefill_overhead_s=c.prefill_overhead_s)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Fitted values from run logs. Save / load as TOML; the twin (`twin.calibrated`) and the planner use them."""
    groups: tuple[GroupCalibration, ...]
    trainer_accelerator: str
    trainer_gpus: int
    trainer_scale: Fitted            # multiplier on the prior trainer compute time (1 / MFU ratio)
    trainer_overhead_s: Fitted       # fixed seconds per trainer update
    update_overhead_s: Fitted        # seconds per update outside train + sync (checkpoint, logging)
    turn_latency_s: Fitted           # seconds between a reply and the session's next request
    model: str = ""
    runs: tuple[str, ...] = ()
    workload: dict[str, Any] | None = None   # the measured workload (workload_from_dict table)
    residuals: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    created_utc: str = ""
    source_path: str = ""
    skipped: tuple[str, ...] = ()            # what of the run logs was left out of the fit, and why

    def group(self, name: str = "", key: tuple[str, str, str, str] | None = None) -> GroupCalibration | None:
        """The calibration of a group: same name first, else same (accelerator, precision, kv_dtype, kernel)."""
        for g in self.groups:
            if name and g.name == name:
                return g
        if key is not None:
            for g in self.groups:
                if g.key == key:
                    return g
        return None

    def trainer_step_s(self, model: ModelSpec, catalog: Catalog, gpus: int, tokens: Any) -> Any:
        """Calibrated seconds of one update's train step (+ the per-update overhead outside train and sync)."""
        acc = catalog.accelerator(self.trainer_accelerator)
        base = np.asarray(trainer_step_s(model, acc, gpus, tokens, overhead_s=0.0), dtype=np.float64)
        base = base * self.trainer_gpus / gpus  # compute scales with GPUs; the fit was at trainer_gpus
        out = self.trainer_scale.value * base + self.trainer_overhead_s.value + self.update_overhead_s.value
        return float(out) if np.ndim(out) == 0 else out

    def workload_spec(self, base: WorkloadSpec | None = None) -> WorkloadSpec | None:
        """The measured workload (batch sizes and context limit from `base` when given)."""
        if self.workload is None:
            return None
        raw = dict(self.workload)
        if base is not None:
            raw.update(prompts_per_update=base.prompts_per_update, samples_per_prompt=base.samples_per_prompt,
                       max_context=base.max_context)
        return workload_from_dict(raw, where=f"{self.source_path or 'calibration'} [workload]")

    # ---- TOML ------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA, "created_utc": self.created_utc, "model": self.model,
                               "runs": list(self.runs),
                               "trainer": {"accelerator": self.trainer_accelerator, "gpus": self.trainer_gpus,
                                           "scale": self.trainer_scale.to_dict(),
                                           "overhead_s": self.trainer_overhead_s.to_dict(),
                                           "update_overhead_s": self.update_overhead_s.to_dict()},
                               "turn_latency_s": self.turn_latency_s.to_dict(),
                               "residuals": {k: float(v) for k, v in self.residuals.items() if math.isfinite(v)},
                               "counts": {k: int(v) for k, v in self.counts.items()}}
        groups = []
        for g in self.groups:
            d: dict[str, Any] = {"name": g.name, "accelerator": g.accelerator, "precision": g.precision,
                                 "kv_dtype": g.kv_dtype, "kernel": g.kernel, "trajectories": g.trajectories}
            if math.isfinite(g.residual_rel_rms):
                d["residual_rel_rms"] = g.residual_rel_rms
            for p in GROUP_PARAMS:
                d[p] = getattr(g, p).to_dict()
            groups.append(d)
        out["groups"] = groups
        if self.workload is not None:
            out["workload"] = self.workload
        if self.skipped:
            out["skipped"] = list(self.skipped)
        return out

    def save(self, path: str | os.PathLike[str]) -> Path:
        import tomli_w

        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(tomli_w.dumps(self.to_dict()))
        os.replace(tmp, path)
        return path

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "calibration") -> Calibration:
        if raw.get("schema") != SCHEMA:
            raise SpecError(where, "schema", raw.get("schema"), f"{SCHEMA} (a file written by `mixfleet calibrate`)")
        tr = raw.get("trainer")
        if not isinstance(tr, dict):
            raise SpecError(where, "trainer", tr, "a [trainer] table")
        for k in ("accelerator", "gpus", "scale", "overhead_s", "update_overhead_s"):
            if k not in tr:
                raise SpecError(f"{where} [trainer]", k, None, "a value (the field is required)")
        groups = []
        graw = raw.get("groups", [])
        if not isinstance(graw, list) or not graw:
            raise SpecError(where, "groups", graw, "a non-empty array of [[groups]] tables")
        for i, g in enumerate(graw):
            w = f"{where} [[groups]] #{i + 1}"
            if not isinstance(g, dict):
                raise SpecError(where, f"groups[{i}]", g, "a table")
            for k in ("name", "accelerator", "precision", "kv_dtype", *GROUP_PARAMS):
                if k not in g:
                    raise SpecError(w, k, None, "a value (the field is required)")
            groups.append(GroupCalibration(
                name=str(g["name"]), accelerator=str(g["accelerator"]), precision=str(g["precision"]),
                kv_dtype=str(g["kv_dtype"]), kernel=str(g.get("kernel", "")),
                trajectories=int(g.get("trajectories", 0)),
                residual_rel_rms=float(g.get("residual_rel_rms", math.nan)),
                **{p: Fitted.from_dict(g[p], f"{w} {p}") for p in GROUP_PARAMS}))
        wl = raw.get("workload")
        if wl is not None:
            workload_from_dict(wl, where=f"{where} [workload]")  # validate now
        if "turn_latency_s" not in raw:
            raise SpecError(where, "turn_latency_s", None, "a value (the field is required)")
        return cls(groups=tuple(groups), trainer_accelerator=str(tr["accelerator"]), trainer_gpus=int(tr["gpus"]),
                   trainer_scale=Fitted.from_dict(tr["scale"], f"{where} trainer.scale"),
                   trainer_overhead_s=Fitted.from_dict(tr["overhead_s"], f"{where} trainer.overhead_s"),
                   update_overhead_s=Fitted.from_dict(tr["update_overhead_s"], f"{where} trainer.update_overhead_s"),
                   turn_latency_s=Fitted.from_dict(raw["turn_latency_s"], f"{where} turn_latency_s"),
                   model=str(raw.get("model", "")), runs=tuple(str(r) for r in raw.get("runs", [])), workload=wl,
                   residuals={k: float(v) for k, v in raw.get("residuals", {}).items()},
                   counts={k: int(v) for k, v in raw.get("counts", {}).items()},
                   created_utc=str(raw.get("created_utc", "")), source_path=where,
                   skipped=tuple(str(x) for x in raw.get("skipped", [])))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Calibration:
        path = Path(path)
        if not path.is_file():
            raise SpecError("calibration", "path", str(path), "an existing TOML file written by `mixfleet calibrate`")
        return cls.from_dict(read_toml(path), where=str(path))

    def table(self) -> list[tuple[str, str, Fitted]]:
        """(scope, parameter, Fitted) rows for printing."""
        rows: list[tuple[str, str, Fitted]] = [
            ("trainer", "scale", self.trainer_scale), ("trainer", "overhead_s", self.trainer_overhead_s),
            ("trainer", "update_overhead_s", self.update_overhead_s),
            ("sessions", "turn_latency_s", self.turn_latency_s)]
        for g in self.groups:
            rows += [(g.name, p, getattr(g, p)) for p in GROUP_PARAMS]
        return rows


# ---- reading what the fit needs from a run log --------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class _Run:
    path: str
    log: RunLog
    plan: PlanData
    model: ModelSpec
    catalog: Catalog
    workload: WorkloadSpec
    groups: dict[str, GroupPlan]
    trainer_accelerator: str
    trainer_gpus: int


def _skip(skipped: list[str], note: str) -> None:
    """Say what of a run log the fit leaves out and why (a CalibrationWarning now, `Calibration.skipped` after)."""
    skipped.append(note)
    warnings.warn(f"calibration: {note}", CalibrationWarning, stacklevel=3)


@dataclass(frozen=True, kw_only=True)
class FrameLog:
    """A run log held in memory: the four tables as DataFrames (the columns `RunLog` reads) and the header, e.g.
    a window of a run still going (`policies.replan` fits its groups from one). `known`: the run-clock windows
    (after, until] in which the frames hold every session that ran (see `complete_windows`); None: derived from
    the prompt ids as for a log on disk."""
    header: dict[str, Any]
    trajectories: pd.DataFrame
    updates: pd.DataFrame
    groups: pd.DataFrame
    events: pd.DataFrame
    directory: str = "<in memory>"
    known: tuple[tuple[float, float], ...] | None = None
    skipped: tuple[Any, ...] = ()
    skip_reasons: dict[Any, str] = field(default_factory=dict)


def _read_run(path: str | os.PathLike[str] | FrameLog, missing: list[str],
              skipped: list[str] | None = None) -> _Run | None:
    if isinstance(path, FrameLog):
        log: Any = path
        where = path.directory
    else:
        where = str(path)
        why = RunLog.not_a_run_log(path)
        if why is not None:
            missing.append(f"{where}: not a run log ({why})")
            return None
        with warnings.catch_warnings():           # said once below, as what the calibration leaves out
            warnings.simplefilter("ignore", RunLogWarning)
            log = RunLog.open(path)
    for part in log.skipped:
        _skip(skipped if skipped is not None else [], f"run log {where}: part {part.parent.name}/{part.name} "
              f"skipped, its rows are not in the fit: unreadable ({log.skip_reasons.get(part, 'unknown')})")
    raw = log.header.get("plan")
    if not isinstance(raw, dict) or not raw.get("groups"):
        missing.append(f"{where}: the header has no plan with groups (which accelerator / precision ran)")
        return None
    try:
        plan = plan_data_from_dict(raw)   # the schema that wrote it, every field checked
        model = load_model_spec(plan.model)
        catalog = load_catalog(plan.price_table or None)
        workload = load_workload(plan.workload)
    except SpecError as e:
        missing.append(f"{where}: its plan names something unknown ({e})")
        return None
    return _Run(path=where, log=log, plan=plan, model=model, catalog=catalog, workload=workload,
                groups={g.name: g for g in plan.groups}, trainer_accelerator=plan.trainer.accelerator,
                trainer_gpus=plan.trainer.gpus)


def _prior_replica(run: _Run, g: GroupPlan) -> ReplicaModel:
    """The prior replica model of a group, as the twin builds it."""
    return group_replica_model(run.plan, g, run.model, run.catalog, run.workload)


def loop_start_s(log: RunLog) -> float:
    """When the run's first prompts started on the run clock (runner: header elapsed - loop_s; else 0)."""
    h = log.header
    loop_s = h.get("loop_s")
    up = log.updates
    if isinstance(loop_s, int | float) and math.isfinite(loop_s) and len(up):
        return max(0.0, float(up["end_s"].max()) - float(loop_s))
    tr = log.trajectories
    return float(tr["start_s"].min()) if len(tr) and h.get("source") == "runner" else 0.0


def _replica_features(tr: pd.DataFrame, rm: ReplicaModel, rm_pf0: ReplicaModel, turn_latency_s: float = 0.0,
                      keep: np.ndarray | None = None) -> pd.DataFrame:
    """Per trajectory of one replica: the regressors of the duration model (see the module doc).

    A trajectory counts in the replica's concurrency for the share of its life it is not between turns
    (turns - 1 gaps of `turn_latency_s`); its prefill work and calls are spread evenly over its life. Only
    the trajectories `keep` marks (inside a window in which the log knows every session that ran: `in_windows`)
    are returned (all of them when None); all of them count in the concurrency."""
    s = tr["start_s"].to_numpy(dtype=np.float64)
    e = tr["end_s"].to_numpy(dtype=np.float64)
    dur = np.maximum(e - s, 1e-9)
    tok = tr["generated_tokens"].to_numpy(dtype=np.float64)
    turns = np.maximum(tr["turns"].to_numpy(dtype=np.float64), 1.0)
    ptok = tr["prompt_tokens"].to_numpy(dtype=np.float64)
    active = np.clip(1.0 - (turns - 1.0) * turn_latency_s / dur, 0.05, 1.0)
    lmid = ptok / 2.0 + (ptok + tok) / 4.0   # mean context while decoding, roughly (grows over the turns)
    per_call = ptok / turns
    # prefill per request as the twin charges it (`replica_prefill_s`: the forward's time / attention-DP ranks)
    pf_s = turns * (np.asarray(rm_pf0.prefill_s(per_call), dtype=np.float64)
                    + rm.slowdown * rm.prefill_overhead_s) / rm.dp_attention
    # piecewise-constant timeline of the replica: concurrency, summed context, prefill seconds per second
    t = np.unique(np.concatenate([s, e]))
    i_s, i_e = np.searchsorted(t, s), np.searchsorted(t, e)
    k = len(t)

    def seg_sum(w: np.ndarray) -> np.ndarray:
        d = np.zeros(k + 1)
        np.add.at(d, i_s, w)
        np.add.at(d, i_e, -w)
        return np.cumsum(d)[:-1]          # value on segment [t_j, t_j+1)

    n = seg_sum(active)
    lsum = seg_sum(active * lmid)
    pf_rate = seg_sum(pf_s / dur)
    width = np.diff(t, append=t[-1])
    busy = n > 1e-9
    nb = np.clip(np.where(busy, n, 1.0), 1.0, running_cap(rm))   # the twin's cap: 256 per attention-DP rank
    lb = np.where(busy, lsum / np.where(busy, n, 1.0), 1.0)
    step = np.asarray(rm.decode_step_s(nb, lb), dtype=np.float64)
    inv = np.where(busy, 1.0 / step, 0.0)

    def cum(rate: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(rate * width)[:-1]])

    g_inv, h_pf, c_n = cum(inv), cum(pf_rate), cum(n)
    mean_inv = (g_inv[i_e] - g_inv[i_s]) / dur
    decode_s = tok / np.maximum(mean_inv, 1e-300)
    stalls = active * (h_pf[i_e] - h_pf[i_s])          # prefills delay a session only while it is not between turns
    out = pd.DataFrame({"dur": dur, "work": decode_s + stalls, "tool": turns - 1.0,
                        "n_mean": (c_n[i_e] - c_n[i_s]) / dur, "tokens": tok})
    return out[keep].reset_index(drop=True) if keep is not None else out


def complete_until_s(tr: pd.DataFrame, inflight_prompts: int | None = None, first_prompt_id: int = 0) -> float:
    """The run-clock time before which every session that ran is in the trajectories table.

    Sessions still running (or finished but not yet trained) when a log ends are not logged, so the
    replicas' concurrency near the end is unknown. Prompts start in id order: if prompts 0..P are all
    logged, every session started before prompt P+1 is in the log, and P+1 started no earlier than P.
    With the batcher's in-flight limit L, prompt P+1 (>= L) also started no earlier than the (P+2-L)-th
    completion of a prompt (at most L prompts run at once), which is known since those are all logged.
    `first_prompt_id`: the ids count from there (a resumed run's segment, see `complete_windows`)."""
    if not len(tr):
        return -math.inf
    ids = pd.to_numeric(tr["prompt_id"], errors="coerce")
    if ids.isna().any():
        return float(tr["end_s"].max())
    logged = set(int(i) for i in ids.unique())
    p = first_prompt_id - 1
    while p + 1 in logged:
        p += 1
    if p < first_prompt_id:
        return -math.inf
    known = (ids >= first_prompt_id) & (ids <= p)
    bound = float(tr.loc[known, "start_s"].max())
    started = p + 1 - first_prompt_id
    if inflight_prompts is not None and inflight_prompts >= 1 and started >= inflight_prompts:
        done = np.sort(tr.loc[known].groupby(ids[known])["end_s"].max().to_numpy(dtype=np.float64))
        k = started - inflight_prompts
        if k < len(done):
            bound = max(bound, float(done[k]))
    return bound


def complete_windows(log: RunLog, inflight_prompts: int | None = None,
                     skipped: list[str] | None = None) -> list[tuple[float, float]]:
    """The run-clock windows (after, until] in which the log knows every session that ran: one per segment of
    a run resumed after a stop or a kill (its "resume" events). The prompts in flight at a stop are never
    logged, so `complete_until_s` alone would end at the first stop; each resumed segment starts its own
    count at the first prompt id it admitted (the event's `first_prompt_id`; older logs: the smallest id
    of the trajectories that started after the resume). `skipped`: a note is added for each resumed segment
    left out, with the reason."""
    tr = log.trajectories
    windows = [(-math.inf, complete_until_s(tr, inflight_prompts))]
    ev = log.events
    resumes = ev[ev["kind"] == "resume"] if len(ev) else ev
    if not len(resumes) or not len(tr):
        return windows
    name = getattr(log, "directory", "")
    ids = pd.to_numeric(tr["prompt_id"], errors="coerce")
    if ids.isna().any():
        if skipped is not None:
            _skip(skipped, f"run log {name}: its {len(resumes)} resumed segment(s) skipped: prompt ids are not all "
                           "numbers, so which sessions a segment's log knows cannot be told (only its first part is "
                           "used)")
        return windows
    for t_r, detail in zip(resumes["time_s"], resumes["detail"], strict=True):
        try:
            first = json.loads(detail).get("first_prompt_id") if detail else None
        except (ValueError, AttributeError):
            first = None
        if not isinstance(first, int) or isinstance(first, bool):
            after = ids[tr["start_s"] >= float(t_r)]
            if not len(after):
                if skipped is not None:
                    _skip(skipped, f"run log {name}: the segment resumed at {float(t_r):.1f} s skipped: no "
                                   "trajectory of it is in the log")
                continue
            first = int(after.min())
        windows.append((float(t_r), complete_until_s(tr, inflight_prompts, first)))
    return windows


def in_windows(tr: pd.DataFrame, windows: list[tuple[float, float]]) -> np.ndarray:
    """Trajectories that started after and ended by the same window (`complete_windows`)."""
    s = tr["start_s"].to_numpy(dtype=np.float64)
    e = tr["end_s"].to_numpy(dtype=np.float64)
    ok = np.zeros(len(tr), dtype=bool)
    for lo, hi in windows:
        ok |= (s >= lo) & (e <= hi)
    return ok


def inflight_limit(header: dict[str, Any]) -> int | None:
    """The batcher's in-flight prompt limit from a run-log header's plan (None when unknown)."""
    plan = header.get("plan") if isinstance(header, dict) else None
    bat = ((plan or {}).get("policies") or {}).get("batcher") or {}
    v = bat.get("inflight_prompts")
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
        return v
    ppu = bat.get("prompts_per_update")
    return 4 * ppu if isinstance(ppu, int) and ppu >= 1 else None


def _spread_ok(x: np.ndarray, y: np.ndarray) -> bool:
    """Do x and y vary independently enough (their ratio has a cv above MIN_REL_SPREAD)?"""
    ok = (x > 0) & (y > 0)
    if ok.sum() < 3:
        return False
    r = x[ok] / y[ok]
    return bool(np.std(r) / max(np.mean(r), 1e-300) > MIN_REL_SPREAD)


def _lsq(design: np.ndarray, target: np.ndarray, lo: np.ndarray, hi: np.ndarray, x0: np.ndarray,
         weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """Bounded linear least squares on weighted residuals w * (A x - y): (x, stderr, rel_rms, residuals)."""
    from scipy.optimize import least_squares

    def fun(x: np.ndarray) -> np.ndarray:
        return weights * (design @ x - target)

    def jac(_x: np.ndarray) -> np.ndarray:
        return weights[:, None] * design

    x0 = np.clip(x0, lo + 1e-12 * np.abs(lo), hi)
    res = least_squares(fun, x0, jac=jac, bounds=(lo, hi), method="trf", x_scale="jac", xtol=1e-12, ftol=1e-12,
                        gtol=1e-12, max_nfev=200)
    r = fun(res.x)
    m, p = design.shape
    s2 = float(r @ r) / max(m - p, 1)
    J = jac(res.x)
    try:
        cov = s2 * np.linalg.inv(J.T @ J)
        err = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    except np.linalg.LinAlgError:
        err = np.full(p, math.nan)
    return res.x, err, float(np.sqrt(np.mean(r ** 2))) if m else math.nan, r


def _growth_fit(stale: np.ndarray, value: np.ndarray, weight: np.ndarray, prior_v0: float, prior_g: float,
                unit: str) -> tuple[Fitted, Fitted]:
    """value = v0 (1 + g s), bounded least squares (v0 >= 0, 0 <= g <= MAX_GROWTH_PER_VERSION); g fixed at the
    prior when the staleness hardly varies or there are fewer than 3 measurements."""
    ok = np.isfinite(stale) & np.isfinite(value) & np.isfinite(weight) & (weight > 0)
    stale, value, weight = stale[ok], value[ok], weight[ok]
    if len(value) == 0:
        note = "not measured in these run logs (prior kept)"
        return (Fitted(value=prior_v0, prior=prior_v0, unit=unit, fitted=False, note=note),
                Fitted(value=prior_g, prior=prior_g, unit="1/version", fitted=False, note=note))
    w = np.sqrt(weight / weight.mean())
    if not (value > 0).any():
        return (Fitted(value=0.0, stderr=0.0, prior=prior_v0, unit=unit, note="every measurement was 0"),
                Fitted(value=prior_g, prior=prior_g, unit="1/version", fitted=False, note="level 0: prior kept"))
    if len(value) >= 3 and np.std(stale) >= MIN_STALENESS_SPREAD:
        from scipy.optimize import least_squares

        s_ = np.maximum(stale, 0.0)

        def fun(x: np.ndarray) -> np.ndarray:
            return w * (x[0] * (1.0 + x[1] * s_) - value)

        def jac(x: np.ndarray) -> np.ndarray:
            return w[:, None] * np.stack([1.0 + x[1] * s_, x[0] * s_], axis=1)

        scale = max(float(np.abs(value).max()), 1e-300)
        x0 = np.array([max(float(value.mean()), 1e-12 * scale), min(max(prior_g, 0.0), MAX_GROWTH_PER_VERSION)])
        res = least_squares(fun, x0, jac=jac, bounds=([0.0, 0.0], [np.inf, MAX_GROWTH_PER_VERSION]), method="trf",
                            x_scale=np.array([scale, 1.0]), xtol=1e-12, ftol=1e-12, gtol=1e-12, max_nfev=500)
        r = fun(res.x)
        J = jac(res.x)
        s2 = float(r @ r) / max(len(value) - 2, 1)
        try:
            err = np.sqrt(np.clip(np.diag(s2 * np.linalg.inv(J.T @ J)), 0.0, None))
        except np.linalg.LinAlgError:
            err = np.full(2, math.nan)
        at_cap = res.x[1] >= MAX_GROWTH_PER_VERSION * (1 - 1e-9)
        return (Fitted(value=float(res.x[0]), stderr=float(err[0]), prior=prior_v0, unit=unit),
                Fitted(value=float(res.x[1]), stderr=float(err[1]), prior=prior_g, unit="1/version",
                       note=f"at the cap {MAX_GROWTH_PER_VERSION:g} (the level at staleness 0 is near 0)"
                       if at_cap else ""))
    # growth not identifiable: keep the prior growth, fit the level
    A = (1.0 + prior_g * np.maximum(stale, 0.0))[:, None]
    x, err, _, _ = _lsq(A, value, np.array([0.0]), np.array([np.inf]), np.array([max(value.mean(), 1e-12)]), w)
    why = "staleness hardly varied" if len(value) >= 3 else "fewer than 3 measurements"
    return (Fitted(value=float(x[0]), stderr=float(err[0]), prior=prior_v0, unit=unit),
            Fitted(value=prior_g, prior=prior_g, unit="1/version", fitted=False, note=f"{why}: prior kept"))


MIN_LEVEL_SHARE = 0.01   # the fitted KL at staleness 0 is kept >= this share of the KL at the run's mean staleness


def _mismatch_split(gr: pd.DataFrame, prior: Any) -> tuple[Fitted, Fitted, Fitted, Fitted] | None:
    """KL and extreme-ratio share as a function of staleness from one run's own range of staleness.

    Every update's group row splits its tokens in two points: its staleness-0 tokens (`kl_k3_on_policy`,
    `tokens_on_policy`: the precision and format mismatch alone) and the rest, whose KL and mean staleness follow
    from the row's totals (kl_off = (kl N - kl_on N_on) / (N - N_on) at s_off = s N / (N - N_on)). A line
    kl(s) = a + b s (a, b >= 0: format level, drift per version of staleness) through those points is fitted by
    weighted least squares (weights: tokens) with its stderr, so a run whose updates all have the same mean
    staleness still separates the two. The twin's form is kl0 (1 + g s); a run whose mismatch is almost all
    staleness (a ~ 0: a tiny model trained at a high learning rate) gets kl0 = max(a, MIN_LEVEL_SHARE x kl(s_run))
    and g so that kl0 (1 + g s_run) = a + b s_run. The extreme-ratio share has no staleness-0 split in the log: it
    is taken proportional to the KL, ext(s) = r kl(s), r = sum(ext N) / sum(kl N) over the run (its stderr from
    the updates' spread), so it grows with the same g. None when the rows hold no staleness-0 and stale tokens
    (older logs, or an on-policy run): the caller fits the per-update means instead (`_growth_fit`)."""
    prior_kl, prior_ext, prior_g = prior.kl_k3, prior.extreme_share, prior.growth_per_staleness
    need = ("kl_k3_on_policy", "tokens_on_policy", "tokens_trained", "kl_k3", "staleness_mean", "extreme_share")
    if not all(c in gr for c in need) or not len(gr):
        return None
    n = gr["tokens_trained"].to_numpy(dtype=np.float64)
    n_on = gr["tokens_on_policy"].to_numpy(dtype=np.float64)
    kl = gr["kl_k3"].to_numpy(dtype=np.float64)
    kl_on = gr["kl_k3_on_policy"].to_numpy(dtype=np.float64)
    st = gr["staleness_mean"].to_numpy(dtype=np.float64)
    ok = np.isfinite(kl) & np.isfinite(st) & (n > 0)
    on = ok & np.isfinite(kl_on) & (n_on > 0)
    off = ok & (n - np.where(on, n_on, 0.0) > 0) & (st > 0)
    if on.sum() < 1 or off.sum() < 1 or on.sum() + off.sum() < 3:
        return None
    n_off = n - np.where(on, n_on, 0.0)
    kl_off = (kl * n - np.where(on, kl_on * n_on, 0.0)) / np.maximum(n_off, 1e-300)
    s_off = st * n / np.maximum(n_off, 1e-300)
    xs = np.concatenate([np.zeros(int(on.sum())), s_off[off]])
    ys = np.concatenate([kl_on[on], np.maximum(kl_off[off], 0.0)])
    ws = np.concatenate([n_on[on], n_off[off]])
    design = np.stack([np.ones_like(xs), xs], axis=1)
    w = np.sqrt(ws / ws.mean())
    scale = max(float(np.abs(ys).max()), 1e-12)
    (a, b), (ea, eb), _, resid = _lsq(design, ys / scale, np.array([0.0, 0.0]), np.array([np.inf, np.inf]),
                                      np.array([max(float(ys.min()), 0.0) / scale, 0.0]), w)
    a, b, ea, eb = a * scale, b * scale, ea * scale, eb * scale
    s_run = float((st[ok] * n[ok]).sum() / n[ok].sum())
    at_run = a + b * s_run
    # the line's value at the run's own staleness is what a plan at that staleness inherits: its stderr from the
    # covariance of (a, b), which the intercept and slope alone overstate (they trade against each other)
    J = w[:, None] * design
    try:
        cov = float(resid @ resid) / max(len(ys) - 2, 1) * np.linalg.inv(J.T @ J) * scale ** 2
        e_run = float(math.sqrt(max(np.array([1.0, s_run]) @ cov @ np.array([1.0, s_run]), 0.0)))
    except np.linalg.LinAlgError:
        e_run = math.nan
    level = max(a, MIN_LEVEL_SHARE * at_run)
    g = (at_run / level - 1.0) / s_run if level > 0 and s_run > 0 else 0.0
    eg = float(eb / level) if level > 0 else math.nan
    note = (f"kl(s) = {a:.3g} (+- {ea:.2g}) + {b:.3g} (+- {eb:.2g}) x s, fitted on the run's staleness "
            f"0..{xs.max():.2f}; kl at its mean staleness {s_run:.2f}: {at_run:.3g} +- {e_run:.2g}")
    if level > a:
        note += f"; kl0 kept at {MIN_LEVEL_SHARE:.0%} of kl at the run's staleness {s_run:.2f}"
    ext = gr["extreme_share"].to_numpy(dtype=np.float64)
    eok = ok & np.isfinite(ext)
    r = float((ext[eok] * n[eok]).sum() / max((kl[eok] * n[eok]).sum(), 1e-300)) if eok.any() else math.nan
    per = ext[eok] / np.where(kl[eok] > 0, kl[eok], np.nan)
    per = per[np.isfinite(per)]
    er = float(per.std(ddof=1) / math.sqrt(len(per))) if len(per) > 1 else math.nan
    kl0 = Fitted(value=float(level), stderr=float(ea), prior=prior_kl, unit="nats/token", note=note)
    klg = Fitted(value=float(g), stderr=eg, prior=prior_g, unit="1/version",
                 note="drift per version / level (the line above)")
    if math.isfinite(r):
        ex0 = Fitted(value=float(r * level), stderr=float(er * level) if math.isfinite(er) else math.nan,
                     prior=prior_ext, unit="share", note=f"proportional to the KL: ext = {r:.3g} x kl(s)")
        exg = Fitted(value=float(g), stderr=eg, prior=prior_g, unit="1/version",
                     note="the KL's (extreme share taken proportional to the KL)")
    else:
        note_e = "not measured in these run logs (prior kept)"
        ex0 = Fitted(value=prior_ext, prior=prior_ext, unit="share", fitted=False, note=note_e)
        exg = Fitted(value=prior_g, prior=prior_g, unit="1/version", fitted=False,
                     note=note_e)
    return kl0, klg, ex0, exg


def _round_values(x: np.ndarray) -> list[float]:
    return [float(v) for v in np.round(x, 6)]


def _subsample(x: np.ndarray) -> np.ndarray:
    x = np.sort(np.asarray(x, dtype=np.float64))
    if len(x) <= EMPIRICAL_MAX_VALUES:
        return x
    return x[np.linspace(0, len(x) - 1, EMPIRICAL_MAX_VALUES).round().astype(int)]


def _measured_workload(trs: list[pd.DataFrame], base: WorkloadSpec, turn_latency_s: float) -> dict[str, Any]:
    """The workload the runs really had: empirical turns, first prompt, reply tokens; tool tokens by regression."""
    tr = pd.concat(trs, ignore_index=True)
    turns = np.maximum(tr["turns"].to_numpy(dtype=np.float64), 1.0)
    ptok = tr["prompt_tokens"].to_numpy(dtype=np.float64)
    gen = tr["generated_tokens"].to_numpy(dtype=np.float64)
    # prompt_tokens = first prompt + (turns - 1) * tool output tokens: least squares with both >= 0
    if np.std(turns) > 0:
        A = np.stack([np.ones_like(turns), turns - 1.0], axis=1)
        x, _, _, _ = _lsq(A, ptok, np.array([1.0, 0.0]), np.array([np.inf, np.inf]),
                          np.array([max(ptok.mean(), 1.0), 0.0]), np.ones_like(ptok))
        tool = float(x[1])
    else:
        tool = 0.0
    first = np.maximum(np.rint(ptok - tool * (turns - 1.0)), 1.0)
    reply = np.maximum(np.rint(gen / turns), 1.0)
    reward = tr["reward"].to_numpy(dtype=np.float64)
    success = float(np.clip(np.nanmean(reward > 0), 0.0, 1.0)) if np.isfinite(reward).any() else base.success_prob
    return {
        "name": f"{base.name}-measured", "description": f"measured from {len(tr)} trajectories",
        "source": "mixfleet calibrate", "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "prompts_per_update": base.prompts_per_update, "samples_per_prompt": base.samples_per_prompt,
        "max_context": base.max_context, "success_prob": success, "no_tool_call_prob": base.no_tool_call_prob,
        "turns": {"kind": "empirical", "values": _round_values(_subsample(turns)), "integer": True},
        "prompt_tokens": {"kind": "empirical", "values": _round_values(_subsample(first)), "integer": True},
        "reply_tokens": {"kind": "empirical", "values": _round_values(_subsample(reply)), "integer": True},
        "tool_output_tokens": {"kind": "const", "value": round(tool, 6)},
        "tool_latency_s": {"kind": "const", "value": round(max(turn_latency_s, 0.0), 9)},
    }


# ---- the fit ---------------------------------------------------------------------------------------

GroupKey = tuple[str, str, str, str]   # (accelerator, precision, kv dtype, kernel): what a group is calibrated per


@dataclass(frozen=True, kw_only=True)
class _Logs:
    """The run logs a fit reads, checked: their groups by key, the windows in which each log knows every session."""
    runs: list[_Run]
    paths: list[str]
    keyed: dict[GroupKey, list[tuple[_Run, GroupPlan]]]   # named by the first run's group name
    windows: dict[int, list[tuple[float, float]]]           # id(run) -> `complete_windows`
    counts: dict[GroupKey, int]                             # the trajectories each group's fit can use
    n_updates: int
    skipped: list[str]


def _read_logs(logs: list[str | os.PathLike[str] | FrameLog], min_trajectories: int, min_updates: int) -> _Logs:
    """Read and check the run logs: one model, one trainer, enough updates and trajectories per group; raises
    CalibrationError naming everything that is missing."""
    paths = [p.directory if isinstance(p, FrameLog) else str(p) for p in logs]
    missing: list[str] = []
    skipped: list[str] = []
    if not paths:
        raise CalibrationError(["at least one run log"])
    runs = [r for r in (_read_run(p, missing, skipped) for p in logs) if r is not None]
    if missing:
        raise CalibrationError(missing)
    models = {r.model.name for r in runs}
    trainers = {(r.trainer_accelerator, r.trainer_gpus) for r in runs}
    if len(models) > 1:
        missing.append(f"run logs of one model (got {', '.join(sorted(models))})")
    if len(trainers) > 1:
        missing.append("run logs of one trainer (accelerator, GPUs) (got "
                       + ", ".join(f"{a} x{n}" for a, n in sorted(trainers)) + ")")
    n_updates = sum(len(r.log.updates) for r in runs)
    if n_updates < min_updates:
        missing.append(f"at least {min_updates} trainer updates in all (got {n_updates}): the trainer and weight-sync "
                       "fits need them")
    # group identity: calibrated per (accelerator, precision, kv dtype, kernel); named by the first run's name
    keyed: dict[GroupKey, list[tuple[_Run, GroupPlan]]] = {}
    for r in runs:
        for g in r.groups.values():
            keyed.setdefault((g.accelerator, g.precision, g.kv_dtype, g.kernel), []).append((r, g))
    # per run, once: the windows in which its log knows every session (`complete_windows`) and the
    # trajectories inside them
    windows = {id(r): list(r.log.known) if getattr(r.log, "known", None) is not None
               else complete_windows(r.log, inflight_limit(r.log.header), skipped) for r in runs}
    known = {id(r): in_windows(r.log.trajectories, windows[id(r)]) for r in runs}
    counts: dict[GroupKey, int] = {}
    for key, members in keyed.items():
        n = 0
        for r, g in members:
            tr = r.log.trajectories
            n += int(((tr["group"] == g.name) & (tr["generated_tokens"] > 0) & (tr["end_s"] > tr["start_s"])
                      & known[id(r)]).sum())
        counts[key] = n
        if n < min_trajectories:
            missing.append(f"group {members[0][1].name} ({'/'.join(k for k in key if k)}): at least "
                           f"{min_trajectories} finished trajectories with tokens, ending while the log still knows "
                           f"every session on its replica (got {n}; run more updates)")
    if missing:
        raise CalibrationError(missing + [f"(left out of the fit: {s})" for s in skipped])
    return _Logs(runs=runs, paths=paths, keyed=keyed, windows=windows, counts=counts, n_updates=n_updates,
                 skipped=skipped)


@dataclass(frozen=True, kw_only=True)
class _SessionFit:
    """The duration model's fit: a time scale per group (decode + prefill), the turn latency shared."""
    decode_scale: dict[GroupKey, Fitted]
    prefill_overhead_s: dict[GroupKey, Fitted]
    turn_latency_s: Fitted
    rel_rms: float                              # over every trajectory
    group_rel_rms: dict[GroupKey, float]
    priors: dict[GroupKey, ReplicaModel]        # each group's prior replica model (its first run's)
    trajectories: list[pd.DataFrame]            # the finished trajectories with tokens, per (run, group)
    m: int                                      # trajectories in the fit


def _fit_sessions(data: _Logs) -> _SessionFit:
    """Fit the duration model (module doc) by bounded least squares, refitted SESSION_ITERATIONS times since the
    concurrency it sees depends on the turn latency."""
    keys = list(data.keyed)
    G = len(keys)
    rms: dict[GroupKey, ReplicaModel] = {}
    parts: list[tuple[int, pd.DataFrame, ReplicaModel, np.ndarray]] = []
    trs_all = []
    for gi, key in enumerate(keys):
        for r, g in data.keyed[key]:
            rm = _prior_replica(r, g)
            rms.setdefault(key, rm)
            tr = r.log.trajectories
            tr = tr[(tr["group"] == g.name) & (tr["generated_tokens"] > 0) & (tr["end_s"] > tr["start_s"])]
            trs_all.append(tr)
            for _, rep in tr.groupby("replica", sort=True):
                parts.append((gi, rep, rm, in_windows(rep, data.windows[id(r)])))   # once: the rows the fit uses
    gi_arr = np.concatenate([np.full(int(keep.sum()), gi) for gi, _, _, keep in parts])
    m = len(gi_arr)
    x = np.concatenate([np.ones(G), [0.0]])
    err = np.full(G + 1, math.nan)
    free_tau = True
    note_tau = ""
    for _ in range(SESSION_ITERATIONS):  # the concurrency seen by the duration model depends on the turn latency
        feats = pd.concat([_replica_features(rep, rm, replace(rm, prefill_overhead_s=0.0), x[G], keep)
                           for _, rep, rm, keep in parts], ignore_index=True)
        A = np.zeros((m, G + 1))
        A[np.arange(m), gi_arr] = feats["work"].to_numpy()
        A[:, G] = feats["tool"].to_numpy()
        y = feats["dur"].to_numpy()
        w = 1.0 / y if DURATION_RESIDUALS == "relative" else np.full(m, 1.0 / max(float(y.mean()), 1e-300))
        tool = A[:, G]
        free_tau = bool((tool > 0).any()) and _spread_ok(tool + 1e-9, A[np.arange(m), gi_arr])
        if not free_tau:
            note_tau = "turn counts hardly varied apart from the work: kept at 0"
        cols = list(range(G)) + ([G] if free_tau else [])
        lo = np.array([1e-4] * G + ([0.0] if free_tau else []))
        hi = np.full(len(cols), np.inf)
        xf, ef, sess_rms, resid = _lsq(A[:, cols], y, lo, hi, x[cols], w)
        x[cols], err[cols] = xf, ef
        if not free_tau:
            x[G], err[G] = 0.0, math.nan
    group_rms = {}
    for gi, key in enumerate(keys):
        rel = resid[gi_arr == gi]
        group_rms[key] = float(np.sqrt(np.mean(rel ** 2))) if len(rel) else math.nan
    return _SessionFit(
        decode_scale={key: Fitted(value=float(x[gi]), stderr=float(err[gi]), prior=1.0, unit="x")
                      for gi, key in enumerate(keys)},
        prefill_overhead_s={key: Fitted(value=float(x[gi]) * rms[key].prefill_overhead_s,
                                        stderr=float(err[gi]) * rms[key].prefill_overhead_s,
                                        prior=rms[key].prefill_overhead_s, unit="s", fitted=False,
                                        note="scaled with decode_scale (steady-state logs do not separate prefill "
                                        "from decode time)") for gi, key in enumerate(keys)},
        turn_latency_s=Fitted(value=float(x[G]), stderr=float(err[G]), prior=0.0, unit="s", fitted=free_tau,
                              note=note_tau),
        rel_rms=sess_rms, group_rel_rms=group_rms, priors=rms, trajectories=trs_all, m=m)


def _fit_trainer(runs: list[_Run]) -> tuple[Fitted, Fitted, float]:
    """The trainer's scale on its prior roofline compute time and its fixed overhead per update (the overhead kept
    at the catalog's prior when the tokens per update do not separate the two), and the fit's RMS in seconds."""
    up = pd.concat([r.log.updates.assign(_run=i) for i, r in enumerate(runs)], ignore_index=True)
    r0 = runs[0]
    tacc = r0.catalog.accelerator(r0.trainer_accelerator)
    base_t = np.asarray(trainer_step_s(r0.model, tacc, r0.trainer_gpus, up["tokens"].to_numpy(dtype=np.float64),
                                       overhead_s=0.0), dtype=np.float64)
    train_y = up["train_step_s"].to_numpy(dtype=np.float64)
    ok = np.isfinite(train_y) & (base_t > 0)
    split = ok.sum() >= 3 and _spread_ok(base_t[ok], np.ones(ok.sum()))
    why = "tokens per update hardly varied (or < 3 updates): prior kept"
    if split:
        xt, et, train_rms, _ = _lsq(np.stack([base_t[ok], np.ones(ok.sum())], axis=1), train_y[ok],
                                    np.array([1e-6, 0.0]), np.array([np.inf, np.inf]),
                                    np.array([1.0, tacc.trainer_overhead_s]), np.ones(ok.sum()))
        t_scale = Fitted(value=float(xt[0]), stderr=float(et[0]), prior=1.0, unit="x")
        t_over = Fitted(value=float(xt[1]), stderr=float(et[1]), prior=tacc.trainer_overhead_s, unit="s")
        if not et[0] < xt[0]:   # the slope is not identified (stderr >= value): keep time proportional to tokens
            split, why = False, "slope and overhead not separable here (scale stderr >= value): prior kept"
    if not split:
        xt, et, train_rms, _ = _lsq(base_t[ok][:, None], train_y[ok] - tacc.trainer_overhead_s, np.array([1e-6]),
                                    np.array([np.inf]), np.array([1.0]), np.ones(ok.sum()))
        t_scale = Fitted(value=float(xt[0]), stderr=float(et[0]), prior=1.0, unit="x")
        t_over = Fitted(value=tacc.trainer_overhead_s, prior=tacc.trainer_overhead_s, unit="s", fitted=False,
                        note=why)
    return t_scale, t_over, train_rms


def _fit_update_overhead(runs: list[_Run]) -> Fitted:
    """Seconds between an update's end and the next start that no missing batch explains (mean over updates)."""
    gaps = []
    for r in runs:
        u = r.log.updates.sort_values("version")
        tr = r.log.trajectories
        ready = tr[tr["trained_version"] > 0].groupby("trained_version")["end_s"].max()
        prev_end = np.concatenate([[loop_start_s(r.log)], u["end_s"].to_numpy(dtype=np.float64)[:-1]])
        for (v, start), pe in zip(u[["version", "start_s"]].itertuples(index=False), prev_end, strict=True):
            if v in ready.index and v > u["version"].min():
                gaps.append(max(0.0, float(start) - max(float(pe), float(ready[v]))))
    gaps_a = np.asarray(gaps, dtype=np.float64)
    if len(gaps_a):
        return Fitted(value=float(gaps_a.mean()), stderr=float(gaps_a.std(ddof=1) / math.sqrt(len(gaps_a)))
                      if len(gaps_a) > 1 else math.nan, prior=0.0, unit="s")
    return Fitted(value=0.0, prior=0.0, unit="s", fitted=False, note="needs two updates in one run: prior kept")


def _fit_weight_sync(runs: list[_Run], priors: dict[GroupKey, ReplicaModel]) -> tuple[dict[GroupKey, Fitted], int]:
    """Per group: its mean push duration + the export shared by all groups (update sync - slowest push), or the
    prior where the logs have no push of the group; and the number of pushes read."""
    push_by_key: dict[GroupKey, list[float]] = {k: [] for k in priors}
    export = []
    for r in runs:
        ev = r.log.events
        ev = ev[(ev["kind"] == "weight_push") & np.isfinite(ev["duration_s"])]
        name_key = {g.name: (g.accelerator, g.precision, g.kv_dtype, g.kernel) for g in r.groups.values()}
        for gname, d in zip(ev["group"], ev["duration_s"], strict=True):
            if gname in name_key:
                push_by_key[name_key[gname]].append(float(d))
        slowest = ev.groupby("version")["duration_s"].max()
        for v, sync in zip(r.log.updates["version"], r.log.updates["weight_sync_s"], strict=True):
            if v in slowest.index and math.isfinite(sync):
                export.append(max(0.0, float(sync) - float(slowest[v])))
    export_s = float(np.mean(export)) if export else 0.0
    r0 = runs[0]
    tacc = r0.catalog.accelerator(r0.trainer_accelerator)
    out = {}
    for key, rm in priors.items():
        pushes = np.asarray(push_by_key[key], dtype=np.float64)
        sync_prior = prior_sync(rm, tacc)
        if len(pushes):
            out[key] = Fitted(value=float(pushes.mean()) + export_s, prior=sync_prior, unit="s",
                              stderr=float(pushes.std(ddof=1) / math.sqrt(len(pushes))) if len(pushes) > 1
                              else math.nan, note=f"push {pushes.mean():.4g} s + export {export_s:.4g} s")
        else:
            out[key] = Fitted(value=sync_prior, prior=sync_prior, unit="s", fitted=False,
                              note="no weight_push events for this group: prior kept")
    return out, sum(len(v) for v in push_by_key.values())


def _fit_mismatch(key: GroupKey, members: list[tuple[_Run, GroupPlan]]) -> tuple[Fitted, Fitted, Fitted, Fitted]:
    """A group's KL and extreme-ratio share at staleness 0 and their growth per version of staleness: from the
    on-policy / stale split of its rows where they have one (`_mismatch_split`), else from the per-update means."""
    prior = mismatch_prior(key[0], key[1], key[2])
    gr = pd.concat([r.log.groups[r.log.groups["group"] == g.name] for r, g in members], ignore_index=True)
    wts = gr["tokens_trained"].to_numpy(dtype=np.float64)
    if not (wts > 0).any():
        wts = gr["samples"].to_numpy(dtype=np.float64)
    stale = gr["staleness_mean"].to_numpy(dtype=np.float64)
    split = _mismatch_split(gr, prior)
    if split is not None:   # the run's own staleness range: its on-policy tokens against its stale ones
        return split
    kl0, klg = _growth_fit(stale, gr["kl_k3"].to_numpy(dtype=np.float64), wts, prior.kl_k3,
                           prior.growth_per_staleness, "nats/token")
    ex0, exg = _growth_fit(stale, gr["extreme_share"].to_numpy(dtype=np.float64), wts, prior.extreme_share,
                           prior.growth_per_staleness, "share")
    return kl0, klg, ex0, exg


def calibrate(runlogs: Iterable[str | os.PathLike[str] | FrameLog], *,
              min_trajectories: int = MIN_TRAJECTORIES_PER_GROUP, min_updates: int = MIN_UPDATES) -> Calibration:
    """Fit a Calibration to one or more run logs of the same model and trainer (see the module doc): folders, or
    `FrameLog`s held in memory (a window of a running run). The fits: sessions (`_fit_sessions`), trainer
    (`_fit_trainer`, `_fit_update_overhead`), weight sync (`_fit_weight_sync`), mismatch (`_fit_mismatch`).

    Raises CalibrationError naming everything that is missing when the logs hold too little data.
    """
    data = _read_logs(list(runlogs), min_trajectories, min_updates)
    runs, r0 = data.runs, data.runs[0]
    sess = _fit_sessions(data)
    t_scale, t_over, train_rms = _fit_trainer(runs)
    upd_over = _fit_update_overhead(runs)
    sync, pushes = _fit_weight_sync(runs, sess.priors)
    groups_out = []
    resid_by_group = {}
    for key, members in data.keyed.items():
        name = members[0][1].name
        kl0, klg, ex0, exg = _fit_mismatch(key, members)
        resid_by_group[name] = sess.group_rel_rms[key]
        groups_out.append(GroupCalibration(
            name=name, accelerator=key[0], precision=key[1], kv_dtype=key[2], kernel=key[3],
            decode_scale=sess.decode_scale[key], prefill_overhead_s=sess.prefill_overhead_s[key],
            weight_sync_s=sync[key], kl_k3=kl0, kl_growth_per_staleness=klg, extreme_share=ex0,
            extreme_growth_per_staleness=exg, trajectories=data.counts[key], residual_rel_rms=resid_by_group[name]))
    workload = _measured_workload(sess.trajectories, r0.workload, sess.turn_latency_s.value)
    return Calibration(
        groups=tuple(groups_out), trainer_accelerator=r0.trainer_accelerator, trainer_gpus=r0.trainer_gpus,
        trainer_scale=t_scale, trainer_overhead_s=t_over, update_overhead_s=upd_over,
        turn_latency_s=sess.turn_latency_s, model=r0.model.name, runs=tuple(data.paths), workload=workload,
        residuals={"duration_rel_rms": sess.rel_rms, "train_step_rms_s": train_rms,
                   **{f"duration_rel_rms[{k}]": v for k, v in resid_by_group.items()}},
        counts={"runs": len(runs), "updates": data.n_updates, "trajectories": int(sess.m), "weight_pushes": pushes},
        created_utc=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), skipped=tuple(data.skipped))


def calibration_dict(cal: Calibration) -> dict[str, Any]:
    """JSON-ready dict (for --json)."""
    d = cal.to_dict()
    d.pop("workload", None)
    return d


__all__ = ["Calibration", "CalibrationError", "FrameLog", "Fitted", "GroupCalibration", "calibrate",
           "calibration_dict"]
