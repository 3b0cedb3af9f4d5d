"""The weight-sync fit: per group, its mean push plus the export shared by all groups.
"""

from __future__ import annotations

import math

import numpy as np
from mixfleet.costmodel.calibration.logs import GroupKey, _Run
from mixfleet.costmodel.calibration.record import Fitted
from mixfleet.costmodel.steptime.roofline import ReplicaModel
from mixfleet.costmodel.steptime.roofline import weight_sync_s as prior_sync


def _fit_weight_sync(runs: list[_Run], priors: dict[GroupKey, ReplicaModel]) -> tuple[dict[GroupKey, Fitted], int]:
    """Per group: its mean push duration + the export shared by all groups (update sync - slowest push), or the
    prior where the logs have no push of the group; and the number of pushes read."""
    push_by_key: dict[GroupKey, list[float]] = {k: [] for k in priors}
    export = []
    for r in runs:
        ev = r.log.events
        ev = ev[(ev["kind"] == "weight_push") & np.isfinite(ev["duration_s"])]
        name_key = {g.name: k for g in r.groups.values()
                    if (k := (g.accelerator, g.precision, g.kv_dtype, g.kernel)) in push_by_key}  # fitted groups
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
