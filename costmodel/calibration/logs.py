"""What a fit reads from run logs: the logs checked (one model, one trainer, enough updates and trajectories
per group), held in memory (`FrameLog`) or on disk, and the run-clock windows in which a log knows every
session that ran.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from mixfleet.costmodel.calibration.record import CalibrationError, CalibrationWarning
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.plan.planspec import GroupPlan, PlanData, group_replica_model, plan_data_from_dict
from mixfleet.costmodel.records.runlog import RunLog, RunLogWarning
from mixfleet.costmodel.specs.catalog import Catalog, load_catalog
from mixfleet.costmodel.specs.model import ModelSpec, load_model_spec
from mixfleet.costmodel.specs.workload import WorkloadSpec, load_workload
from mixfleet.costmodel.steptime.roofline import ReplicaModel

MIN_UPDATES = 2                    # the trainer fit and a time per update need two updates
MIN_TRAJECTORIES_PER_GROUP = 10    # the duration fit of a group


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
    # a group no log ran (0 replicas throughout, no trajectory: the nvfp4 group of tiny-cpu-xval) has nothing to
    # fit; it is left out, and a plan that uses it keeps its priors
    for key in list(keyed):
        members = keyed[key]
        if all(g.replicas == 0 and not (r.log.trajectories["group"] == g.name).any() for r, g in members):
            skipped.append(f"group {members[0][1].name}: no replica ran in these run logs (0 replicas); not fitted, "
                           "a plan that uses it keeps its priors")
            del keyed[key]
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


__all__ = ["FrameLog"]
