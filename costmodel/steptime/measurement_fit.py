"""Fit the roofline's efficiency factors to published measurements, judged out of sample (leave one source out).

Groups: (GPU architecture, model kind dense / moe, weight precision). Per group, bounded least squares
(scipy.optimize.least_squares) on log(predicted / published) of its rows fits

- eff_bw: achieved / peak memory bandwidth (what the memory-bound, small-batch regime sees);
- eff_flops: achieved / peak FLOP/s (the compute-bound, large-batch regime);
- decode_overhead_s: fixed seconds per decode step (launches, scheduling: the smallest batches);
- emulation_slowdown: only for groups whose precision the GPU emulates (weight-only kernels);

with 1-sigma uncertainties from the Jacobian (covariance s^2 (J^T J)^-1, s^2 the residual variance); a
group with fewer rows than parameters keeps its priors. Out of sample: for each source, fit on the others
and predict its rows (a group the other sources do not cover keeps its priors); the pooled held-out
factors are compared with the priors' on the same rows. `ships` is true only if the fitted factors beat
the priors out of sample on both the median and the worst factor.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import tomli_w
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import Catalog, load_catalog
from mixfleet.costmodel.steptime.measurements import Measurement, predict_with, ratio_for, row_replica, summarize
from mixfleet.costmodel.steptime.roofline import Efficiency, ReplicaModel

PARAMS = ("eff_bw", "eff_flops", "decode_overhead_s", "emulation_slowdown")
BOUNDS = {"eff_bw": (0.05, 1.0), "eff_flops": (0.02, 1.0), "decode_overhead_s": (0.0, 0.05),
          "emulation_slowdown": (1.0, 4.0)}


def group_of(m: Measurement, catalog: Catalog) -> tuple[str, str, str]:
    """(GPU architecture, model kind, precision) of a row."""
    from mixfleet.costmodel.specs.model import load_model_spec

    return (catalog.accelerator(m.gpu).arch, load_model_spec(m.model).kind, m.precision)


@dataclass(frozen=True, kw_only=True)
class GroupFit:
    arch: str
    kind: str
    precision: str
    n_rows: int
    values: dict[str, float]                 # fitted (or prior, when not fitted)
    stderr: dict[str, float]
    priors: dict[str, float]
    fitted: bool

    def efficiency(self) -> Efficiency:
        return Efficiency(**{k: v for k, v in self.values.items()})


@dataclass(frozen=True, kw_only=True)
class MeasurementFit:
    groups: dict[tuple[str, str, str], GroupFit]
    in_sample: dict[str, Any] = field(default_factory=dict)
    out_of_sample: dict[str, Any] = field(default_factory=dict)      # fitted, held out by source
    priors_same_rows: dict[str, Any] = field(default_factory=dict)   # the priors on the same rows
    per_source: dict[str, Any] = field(default_factory=dict)
    ships: bool = False

    def efficiency_for(self, m: Measurement) -> Efficiency | None:
        from mixfleet.costmodel.specs.model import known_models

        if m.model not in known_models():
            return None
        g = self.groups.get(group_of(m, load_catalog()))
        return g.efficiency() if g is not None and g.fitted else None

    def to_dict(self) -> dict[str, Any]:
        return {"schema": 1, "kind": "roofline factors fitted to published measurements",
                "ships": self.ships, "in_sample": self.in_sample, "out_of_sample": self.out_of_sample,
                "priors_same_rows": self.priors_same_rows, "per_source": self.per_source,
                "groups": [{"arch": g.arch, "kind": g.kind, "precision": g.precision, "n_rows": g.n_rows,
                            "fitted": g.fitted, **{k: g.values[k] for k in g.values},
                            **{f"{k}_stderr": g.stderr[k] for k in g.stderr},
                            **{f"{k}_prior": g.priors[k] for k in g.priors}} for g in self.groups.values()]}

    def save(self, path: str | Path) -> None:
        Path(path).write_text("# mixfleet calibrate --measurements: fitted roofline factors\n"
                              + tomli_w.dumps(_no_none(self.to_dict())))


def _no_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _no_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_no_none(v) for v in x]
    return x


def load_fit(path: str | Path) -> MeasurementFit:
    """Read a saved fit (only the groups' values are needed to price rows)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"fit file not found: {p}")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SpecError(str(p), "<file>", "not TOML", f"valid TOML ({e})") from None
    groups = {}
    for g in raw.get("groups", []):
        vals = {k: float(g[k]) for k in PARAMS if k in g}
        groups[(g["arch"], g["kind"], g["precision"])] = GroupFit(
            arch=g["arch"], kind=g["kind"], precision=g["precision"], n_rows=int(g.get("n_rows", 0)), values=vals,
            stderr={k: float(g.get(f"{k}_stderr", math.nan)) for k in vals},
            priors={k: float(g.get(f"{k}_prior", math.nan)) for k in vals}, fitted=bool(g.get("fitted", False)))
    return MeasurementFit(groups=groups, ships=bool(raw.get("ships", False)))


# ---- fitting ----------------------------------------------------------------------------------------------

@lru_cache(maxsize=4096)
def _prior_replica(m: Measurement) -> ReplicaModel | None:
    try:
        return row_replica(m, "roofline")
    except SpecError:
        return None


def _with(rm: ReplicaModel, vals: dict[str, float]) -> ReplicaModel:
    kw = {k: vals[k] for k in ("eff_bw", "eff_flops", "decode_overhead_s") if k in vals}
    if rm.emulated and "emulation_slowdown" in vals:
        kw["slowdown"] = vals["emulation_slowdown"]
    return replace(rm, **kw)


def _log_ratio(m: Measurement, rm: ReplicaModel) -> float | None:
    v, _, _ = predict_with(m, rm)
    if v is None or not v > 0:
        return None
    return math.log(ratio_for(m, v))


def _priors(rm: ReplicaModel) -> dict[str, float]:
    p = {"eff_bw": rm.eff_bw, "eff_flops": rm.eff_flops, "decode_overhead_s": rm.decode_overhead_s}
    if rm.emulated:
        p["emulation_slowdown"] = rm.slowdown
    return p


def _fit_group(rows: Sequence[tuple[Measurement, ReplicaModel]]) -> tuple[dict[str, float], dict[str, float], bool]:
    from scipy.optimize import least_squares

    priors = _priors(rows[0][1])
    names = list(priors)
    if len(rows) <= len(names):
        return priors, {k: math.nan for k in names}, False
    lo = np.array([BOUNDS[k][0] for k in names])
    hi = np.array([BOUNDS[k][1] for k in names])
    x0 = np.clip(np.array([priors[k] for k in names]), lo + 1e-9, hi - 1e-9)

    def resid(x: np.ndarray) -> np.ndarray:
        vals = dict(zip(names, x, strict=True))
        out = [_log_ratio(m, _with(rm, vals)) for m, rm in rows]
        return np.array([10.0 if r is None else r for r in out])

    sol = least_squares(resid, x0, bounds=(lo, hi), x_scale="jac")
    vals = dict(zip(names, (float(v) for v in sol.x), strict=True))
    dof = max(1, len(rows) - len(names))
    s2 = float(np.sum(sol.fun ** 2)) / dof
    try:
        cov = np.linalg.pinv(sol.jac.T @ sol.jac) * s2
        err = {k: float(math.sqrt(max(cov[i, i], 0.0))) for i, k in enumerate(names)}
    except np.linalg.LinAlgError:
        err = {k: math.nan for k in names}
    return vals, err, True


def _fit_all(rows: Sequence[Measurement], catalog: Catalog) -> dict[tuple[str, str, str], GroupFit]:
    by: dict[tuple[str, str, str], list[tuple[Measurement, ReplicaModel]]] = {}
    for m in rows:
        rm = _prior_replica(m)
        if rm is None or _log_ratio(m, rm) is None:
            continue
        by.setdefault(group_of(m, catalog), []).append((m, rm))
    out = {}
    for key, grp in sorted(by.items()):
        vals, err, ok = _fit_group(grp)
        out[key] = GroupFit(arch=key[0], kind=key[1], precision=key[2], n_rows=len(grp), values=vals, stderr=err,
                            priors=_priors(grp[0][1]), fitted=ok)
    return out


def _ratios(rows: Sequence[Measurement], groups: dict[tuple[str, str, str], GroupFit] | None,
            catalog: Catalog) -> list[float]:
    out = []
    for m in rows:
        rm = _prior_replica(m)
        if rm is None:
            continue
        g = groups.get(group_of(m, catalog)) if groups is not None else None
        if g is not None and g.fitted:
            rm = _with(rm, g.values)
        lr = _log_ratio(m, rm)
        if lr is not None:
            out.append(math.exp(lr))
    return out


def fit_measurements(rows: Sequence[Measurement], catalog: Catalog | None = None) -> MeasurementFit:
    """Fit per (arch, kind, precision) on all rows; report in sample and leave-one-source-out."""
    cat = catalog or load_catalog()
    # serving engines' figures only: a reference-kernel profile is not what the efficiencies describe
    usable = [m for m in rows if m.serving and _prior_replica(m) is not None]
    groups = _fit_all(usable, cat)
    if not groups:         # an empty fit would be written and read as "calibrated": refuse it
        srcs = sorted({m.source for m in rows})
        raise SpecError(f"measurements ({', '.join(srcs) or 'no source'})", "rows",
                        f"{len(rows)} row(s), none priceable",
                        "at least one serving-engine row (sglang, trtllm, vllm) of a model in data/models whose "
                        "setup the cost model can price")
    held_fit: list[float] = []
    held_prior: list[float] = []
    per_source = {}
    for s in sorted({m.source for m in usable}):
        train = [m for m in usable if m.source != s]
        test = [m for m in usable if m.source == s]
        g_train = _fit_all(train, cat)
        rf, rp = _ratios(test, g_train, cat), _ratios(test, None, cat)
        held_fit += rf
        held_prior += rp
        per_source[s] = {"fitted_held_out": summarize(rf), "priors": summarize(rp)}
    oos, pri = summarize(held_fit), summarize(held_prior)
    ships = (oos["n"] > 0 and oos["median_factor"] < pri["median_factor"] and oos["worst_factor"] < pri["worst_factor"])
    return MeasurementFit(groups=groups, in_sample=summarize(_ratios(usable, groups, cat)), out_of_sample=oos,
                          priors_same_rows=pri, per_source=per_source, ships=bool(ships))
