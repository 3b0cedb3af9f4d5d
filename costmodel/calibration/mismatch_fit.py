"""The mismatch fit: a group's KL and extreme-ratio share at staleness 0 and their growth per version
of staleness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from mixfleet.costmodel.calibration.logs import GroupKey, _Run
from mixfleet.costmodel.calibration.lsq import _lsq
from mixfleet.costmodel.calibration.record import Fitted
from mixfleet.costmodel.plan.planspec import GroupPlan
from mixfleet.costmodel.specs.mismatch import mismatch_prior

MIN_STALENESS_SPREAD = 0.25        # versions: below this, growth with staleness is not identifiable


MAX_GROWTH_PER_VERSION = 10.0      # cap on a mismatch's relative growth per version of staleness


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


RUN_COLUMN = "_run"       # which run log a pooled group row came from (`_fit_mismatch`)
MIN_LEVEL_SHARE = 0.01   # the fitted KL at staleness 0 is kept >= this share of the KL at the run's mean staleness


@dataclass(frozen=True)
class StaleKLLine:
    """kl(s) = a + b s through one group's staleness-0 and stale tokens (`stale_kl_line`), and its value at the
    run's mean staleness with two stderrs (1 sigma): `stderr` treats every update as independent; `stderr_robust`
    (a sandwich over versions with the truncated kernel up to `lag` = the run's largest staleness - 1) lets
    consecutive updates' KL move together, as they do: a token s versions stale spans the trainer's last s steps,
    so one large step raises the KL of the next s updates (a moving average of order s - 1, which that kernel
    fits exactly). The robust one is what a prediction of another run of the same plan carries; it still misses
    what differs between runs as a whole (how the policy's entropy evolved: docs/calibration.md)."""
    a: float
    b: float
    a_stderr: float
    b_stderr: float
    staleness: float          # the run's token-weighted mean staleness
    value: float              # a + b x staleness
    stderr: float
    stderr_robust: float
    lag: int
    staleness_max: float      # the largest staleness of the points the line went through
    tokens: np.ndarray        # per row: tokens_trained, kl_k3, the rows used
    kl: np.ndarray
    ok: np.ndarray


def _long_run_cov(scores: np.ndarray, lag: int) -> np.ndarray:
    """Gamma_0 + sum_{l <= lag} (Gamma_l + Gamma_l^T) of per-period score vectors (rows, in time order): the
    truncated (uniform-weight) kernel, exact for a moving average of order `lag`; made positive semi-definite by
    clipping its eigenvalues at 0."""
    meat = scores.T @ scores
    for k in range(1, min(lag, len(scores) - 1) + 1):
        g = scores[k:].T @ scores[:-k]
        meat = meat + g + g.T
    w, v = np.linalg.eigh(meat)
    return (v * np.clip(w, 0.0, None)) @ v.T


def stale_kl_line(gr: pd.DataFrame) -> StaleKLLine | None:
    """The line kl(s) = a + b s of one group's rows (see `_mismatch_split`), or None when the rows hold no
    staleness-0 and stale tokens (older logs, an on-policy run)."""
    need = ("kl_k3_on_policy", "tokens_on_policy", "tokens_trained", "kl_k3", "staleness_mean", "extreme_share")
    if not all(c in gr for c in need) or not len(gr):
        return None
    n = gr["tokens_trained"].to_numpy(dtype=np.float64)
    n_on = gr["tokens_on_policy"].to_numpy(dtype=np.float64)
    kl = gr["kl_k3"].to_numpy(dtype=np.float64)
    kl_on = gr["kl_k3_on_policy"].to_numpy(dtype=np.float64)
    st = gr["staleness_mean"].to_numpy(dtype=np.float64)
    ver = (gr["version"].to_numpy(dtype=np.float64) if "version" in gr else np.arange(len(gr), dtype=np.float64))
    run = gr[RUN_COLUMN].to_numpy(dtype=np.int64) if RUN_COLUMN in gr else np.zeros(len(gr), dtype=np.int64)
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
    vs = np.concatenate([ver[on], ver[off]])
    rs = np.concatenate([run[on], run[off]])
    design = np.stack([np.ones_like(xs), xs], axis=1)
    w = np.sqrt(ws / ws.mean())
    scale = max(float(np.abs(ys).max()), 1e-12)
    (a, b), (ea, eb), _, resid = _lsq(design, ys / scale, np.array([0.0, 0.0]), np.array([np.inf, np.inf]),
                                      np.array([max(float(ys.min()), 0.0) / scale, 0.0]), w)
    a, b, ea, eb = a * scale, b * scale, ea * scale, eb * scale
    s_run = float((st[ok] * n[ok]).sum() / n[ok].sum())
    c = np.array([1.0, s_run])
    lag = max(1, int(math.ceil(float(st[ok].max()) - 1e-9)) - 1)
    # the line's value at the run's own staleness is what a plan at that staleness inherits: its stderr from the
    # covariance of (a, b), which the intercept and slope alone overstate (they trade against each other)
    J = w[:, None] * design
    try:
        bread = np.linalg.inv(J.T @ J)
        cov = float(resid @ resid) / max(len(ys) - 2, 1) * bread * scale ** 2
        e_run = float(math.sqrt(max(c @ cov @ c, 0.0)))
        # scores summed per update (its on-policy and stale points), in version order; runs pooled are independent
        meat, periods = np.zeros((2, 2)), 0
        for rr in np.unique(rs):
            vv = np.unique(vs[rs == rr])
            sel = [(rs == rr) & (vs == v) for v in vv]
            meat = meat + _long_run_cov(np.stack([(J[m] * resid[m, None]).sum(axis=0) for m in sel]), lag)
            periods += len(vv)
        cov_r = periods / max(periods - 2, 1) * bread @ meat @ bread * scale ** 2
        e_rob = float(math.sqrt(max(c @ cov_r @ c, 0.0)))
    except np.linalg.LinAlgError:
        e_run = e_rob = math.nan
    return StaleKLLine(a=float(a), b=float(b), a_stderr=float(ea), b_stderr=float(eb), staleness=s_run,
                       value=float(a + b * s_run), stderr=e_run, stderr_robust=e_rob, lag=lag,
                       staleness_max=float(xs.max()), tokens=n, kl=kl, ok=ok)


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
    line = stale_kl_line(gr)
    if line is None:
        return None
    a, b, ea, eb, s_run, at_run = line.a, line.b, line.a_stderr, line.b_stderr, line.staleness, line.value
    n, kl, ok = line.tokens, line.kl, line.ok
    level = max(a, MIN_LEVEL_SHARE * at_run)
    g = (at_run / level - 1.0) / s_run if level > 0 and s_run > 0 else 0.0
    eg = float(eb / level) if level > 0 else math.nan
    z = 1e-9 * max(abs(a), abs(at_run))       # a bound of 0 reached at round-off (7e-18) reads 0, as in the table

    def g3(x: float) -> str:
        return "0" if abs(x) <= z else f"{x:.3g}"

    note = (f"kl(s) = {g3(a)} (+- {ea:.2g}) + {g3(b)} (+- {eb:.2g}) x s, fitted on the run's staleness "
            f"0..{line.staleness_max:.2f}; kl at its mean staleness {s_run:.2f}: {at_run:.3g} +- {line.stderr:.2g} "
            f"(+- {line.stderr_robust:.2g} with the updates' autocorrelation, lag {line.lag})")
    if level > a:   # said first: the value differs from the line's level the note goes on to give (issue 44: the
        # table cut the note before its end, and what showed contradicted the row)
        note = (f"kl0 = {level:.3g}: kept at {MIN_LEVEL_SHARE:.0%} of kl at the run's mean staleness {s_run:.2f} "
                f"(the line's own level {g3(a)} is below it; the +- is the line level's). " + note)
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


def _fit_mismatch(key: GroupKey, members: list[tuple[_Run, GroupPlan]]) -> tuple[Fitted, Fitted, Fitted, Fitted]:
    """A group's KL and extreme-ratio share at staleness 0 and their growth per version of staleness: from the
    on-policy / stale split of its rows where they have one (`_mismatch_split`), else from the per-update means."""
    prior = mismatch_prior(key[0], key[1], key[2])
    gr = pd.concat([r.log.groups[r.log.groups["group"] == g.name].assign(**{RUN_COLUMN: i})
                    for i, (r, g) in enumerate(members)], ignore_index=True)
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
