"""The duration fit: a time scale per group (decode + prefill) and the shared turn latency, from each
trajectory's duration under processor sharing (the package doc's duration model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd
from mixfleet.costmodel.calibration.logs import GroupKey, _Logs, _prior_replica, in_windows
from mixfleet.costmodel.calibration.lsq import _lsq, _spread_ok
from mixfleet.costmodel.calibration.record import Fitted
from mixfleet.costmodel.plan.planspec import running_cap
from mixfleet.costmodel.steptime.roofline import ReplicaModel

# "absolute" (long ones count more: the fitted scale keeps the mean duration, which the time per update and the
# sandbox-seconds sum) | "relative" (each trajectory counts alike: with multiplicative scatter of relative spread
# s the scale comes out low by about exp(-2 s^2); on an 8-update repo-cpu run (docs/calibration.md), s ~ 0.34,
# the twin's mean episode was 14% short of the run it was fitted on, with "absolute" within 1%; issue 42 item 4)
DURATION_RESIDUALS = "absolute"


SESSION_ITERATIONS = 3             # refits of the duration model (its concurrency uses the fitted turn latency)


def _replica_features(tr: pd.DataFrame, rm: ReplicaModel, rm_pf0: ReplicaModel, turn_latency_s: float = 0.0,
                      keep: np.ndarray | None = None) -> pd.DataFrame:
    """Per trajectory of one replica: the regressors of the duration model (see the module doc).

    A trajectory counts in the replica's concurrency for the share of its life it is not in its tools: its
    logged `tool_s` where the log has one (a real run's tool calls and sandbox waits, the twin's tool
    latencies), else turns - 1 gaps of `turn_latency_s`; its prefill work and calls are spread evenly over its
    life. Its context grows from ~0 to prompt + generated tokens over its life: mean (prompt + generated) / 2.
    Sessions beyond what the replica's KV holds at that context wait, as the engine (and the twin) queues
    them: at concurrency n with room for n_kv, each progresses at n_kv / n of the step rate at n_kv. Only
    the trajectories `keep` marks (inside a window in which the log knows every session that ran: `in_windows`)
    are returned (all of them when None); all of them count in the concurrency."""
    s = tr["start_s"].to_numpy(dtype=np.float64)
    e = tr["end_s"].to_numpy(dtype=np.float64)
    dur = np.maximum(e - s, 1e-9)
    tok = tr["generated_tokens"].to_numpy(dtype=np.float64)
    turns = np.maximum(tr["turns"].to_numpy(dtype=np.float64), 1.0)
    ptok = tr["prompt_tokens"].to_numpy(dtype=np.float64)
    known = np.minimum(logged_tool_s(tr), 0.95 * dur)    # (NaN stays NaN) as `active` below: >= 5% decoding
    gaps = np.where(np.isfinite(known), known, (turns - 1.0) * turn_latency_s)
    active = np.clip(1.0 - gaps / dur, 0.05, 1.0)
    lmid = (ptok + tok) / 2.0                # mean context while decoding (grows from ~0 over the turns)
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
    n_kv = np.clip(rm.kv_capacity_tokens / np.maximum(lb, 1.0), 1.0, None)   # sessions the KV holds at L
    nd = np.minimum(nb, n_kv)
    step = np.asarray(rm.decode_step_s(nd, lb), dtype=np.float64)
    inv = np.where(busy, (nd / nb) / step, 0.0)

    def cum(rate: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum(rate * width)[:-1]])

    g_inv, h_pf, c_n = cum(inv), cum(pf_rate), cum(n)
    mean_inv = (g_inv[i_e] - g_inv[i_s]) / dur
    decode_s = tok / np.maximum(mean_inv, 1e-300)
    stalls = active * (h_pf[i_e] - h_pf[i_s])          # prefills delay a session only while it is not between turns
    out = pd.DataFrame({"dur": dur - np.where(np.isfinite(known), known, 0.0), "work": decode_s + stalls,
                        "tool": np.where(np.isfinite(known), 0.0, turns - 1.0),
                        "n_mean": (c_n[i_e] - c_n[i_s]) / dur, "tokens": tok})
    return out[keep].reset_index(drop=True) if keep is not None else out


def logged_tool_s(tr: pd.DataFrame) -> np.ndarray:
    """Each trajectory's logged seconds in its tools (`tool_s`; NaN where the log has none)."""
    if "tool_s" not in tr.columns:
        return np.full(len(tr), math.nan)
    v = tr["tool_s"].to_numpy(dtype=np.float64)
    return np.where(np.isfinite(v) & (v >= 0.0), v, math.nan)


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


def _tool_s_or_gaps(tr: pd.DataFrame, turn_latency_s: float) -> np.ndarray:
    """Each trajectory's logged tool seconds, or its gaps between turns at `turn_latency_s` where it has none."""
    known = logged_tool_s(tr)
    return np.where(np.isfinite(known), known, np.maximum(tr["turns"].to_numpy(float) - 1.0, 0.0) * turn_latency_s)


def _logged_turn_latency(parts: list[tuple[int, pd.DataFrame, ReplicaModel, np.ndarray]]) -> Fitted | None:
    """The turn latency measured, not fitted, where the log has trajectories' tool seconds: their sum over the
    gaps between turns (stderr: the per-trajectory means' spread); None where no trajectory has them."""
    known = np.concatenate([logged_tool_s(rep)[keep] for _, rep, _, keep in parts])
    gaps = np.concatenate([np.maximum(rep["turns"].to_numpy(float)[keep] - 1.0, 0.0) for _, rep, _, keep in parts])
    ok = np.isfinite(known)
    if not ok.any():
        return None
    per = known[ok & (gaps > 0)] / gaps[ok & (gaps > 0)]
    return Fitted(value=float(known[ok].sum() / max(gaps[ok].sum(), 1e-300)),
                  stderr=float(per.std(ddof=1) / math.sqrt(len(per))) if len(per) > 1 else math.nan,
                  prior=0.0, unit="s", fitted=bool(gaps[ok].sum() > 0),
                  note=f"measured: the logged tool seconds (tool_s) of {int(ok.sum())} trajectories per gap "
                  "between turns (with sandboxes: their starts and pool waits too)")


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
    tau_logged = _logged_turn_latency(parts)
    if tau_logged is not None:      # a trajectory without its tool seconds takes the logged mean per gap
        parts = [(gi, rep.assign(tool_s=_tool_s_or_gaps(rep, tau_logged.value)), rm, keep)
                 for gi, rep, rm, keep in parts]
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
    tau = tau_logged or Fitted(value=float(x[G]), stderr=float(err[G]), prior=0.0, unit="s", fitted=free_tau,
                               note=note_tau)
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
        turn_latency_s=tau,
        rel_rms=sess_rms, group_rel_rms=group_rms, priors=rms, trajectories=trs_all, m=m)
