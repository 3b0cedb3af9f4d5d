"""Bounded linear least squares with standard errors, and the spread test that says whether data identify a
parameter.
"""

from __future__ import annotations

import math

import numpy as np

MIN_REL_SPREAD = 0.02              # a regressor varying less than this (cv) cannot separate two parameters


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
