"""The trainer fit: its scale on the prior compute time, its fixed overhead per update, and the gap
between updates that no missing batch explains.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from mixfleet.costmodel.calibration.logs import _Run, loop_start_s
from mixfleet.costmodel.calibration.lsq import _lsq, _spread_ok
from mixfleet.costmodel.calibration.record import Fitted
from mixfleet.costmodel.steptime.roofline import trainer_step_s


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
