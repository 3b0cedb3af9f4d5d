"""Small validated probability distributions for workload quantities (turns, tokens, latencies).

`Dist` is frozen and keyword-only. Kinds: `const` (value), `uniform` (low, high), `lognormal`
(median + sigma, or mean + cv), `empirical` (values, optional weights). Any kind may be clipped to
[min, max] and rounded to integers (`integer = true`). `.mean` is exact for the clipped distribution
(for integer lognormals, rounding shifts it by < 0.5); `.sample(rng, n)` draws with a numpy Generator.
In TOML a Dist is an inline table, e.g. `turns = { kind = "lognormal", median = 57, sigma = 0.7 }`.

Bounds (costmodel/limits.py): a lognormal's sigma is at most `MAX_LOGNORMAL_SIGMA`; `within(lo, hi, limit)` is
the distribution with its support inside [lo, hi] (what a workload field asks, `WORKLOAD_DIST_BOUNDS`): every
parameter that places an end of the support must lie there, and a lognormal without `max` is clipped at hi.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.limits import MAX_LOGNORMAL_SIGMA, check_in_range
from mixfleet.costmodel.tomlread import check_keys, get_bool, get_float, get_str

DIST_KINDS = ("const", "uniform", "lognormal", "empirical")


def _phi(x: float) -> float:
    """Standard normal CDF."""
    if x == math.inf:
        return 1.0
    if x == -math.inf:
        return 0.0
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True, kw_only=True)
class Dist:
    kind: str                                   # const | uniform | lognormal | empirical
    value: float | None = None                  # const
    low: float | None = None                    # uniform
    high: float | None = None                   # uniform
    mu: float | None = None                     # lognormal: log of the median
    sigma: float | None = None                  # lognormal: std of the log
    values: tuple[float, ...] = ()              # empirical
    weights: tuple[float, ...] = ()             # empirical (normalized on use; empty = equal)
    min: float | None = None                    # clip below (None: no clip)
    max: float | None = None                    # clip above
    integer: bool = False                       # round samples to integers
    where: str = field(default="dist", compare=False, repr=False)  # for error messages

    def __post_init__(self) -> None:
        w = self.where
        if self.kind not in DIST_KINDS:
            raise SpecError(w, "kind", self.kind, DIST_KINDS)
        if self.kind == "const" and not _finite(self.value):
            raise SpecError(w, "value", self.value, "a finite number")
        if self.kind == "uniform":
            if not (_finite(self.low) and _finite(self.high)) or self.high < self.low:
                raise SpecError(w, "high", self.high, f"a finite number >= low ({self.low})")
            if self.integer and math.ceil(self.low) > math.floor(self.high):
                raise SpecError(w, "high", self.high, f"an integer uniform needs an integer in [low, high] "
                                f"(low = {self.low})")
        if self.kind == "lognormal":
            if not _finite(self.mu):
                raise SpecError(w, "median", self.mu, "a positive number")
            if not _finite(self.sigma) or self.sigma < 0:
                raise SpecError(w, "sigma", self.sigma, "a number >= 0")
            if self.sigma > MAX_LOGNORMAL_SIGMA:
                raise SpecError(w, "sigma", self.sigma, f"at most {MAX_LOGNORMAL_SIGMA:g} (MAX_LOGNORMAL_SIGMA, "
                                "costmodel/limits.py)")
        if self.kind == "empirical":
            if not self.values or not all(_finite(v) for v in self.values):
                raise SpecError(w, "values", self.values, "a non-empty list of finite numbers")
            if self.weights and (len(self.weights) != len(self.values) or any(x < 0 for x in self.weights)
                                 or sum(self.weights) <= 0):
                raise SpecError(w, "weights", self.weights,
                                f"{len(self.values)} non-negative numbers with a positive sum (or none)")
        for k in ("min", "max"):
            if getattr(self, k) is not None and not _finite(getattr(self, k)):
                raise SpecError(w, k, getattr(self, k), "a finite number (or none)")
        if self.min is not None and self.max is not None and self.max < self.min:
            raise SpecError(w, "max", self.max, f">= min ({self.min})")

    def within(self, lo: float, hi: float, limit: str) -> Dist:
        """This distribution with its support inside [lo, hi] (`limit`: hi's name in costmodel/limits.py):
        SpecError naming the parameter (value, low, high, median, values, min, max) that places an end of the
        support outside; a lognormal without `max` (its tail is unbounded) is returned clipped at hi."""
        w = self.where
        params: list[tuple[str, float]] = []
        if self.kind == "const":
            params.append(("value", self.value))
        elif self.kind == "uniform":
            params += [("low", self.low), ("high", self.high)]
        elif self.kind == "lognormal":
            params.append(("median", float(f"{math.exp(self.mu):.12g}")))   # as written (exp(log(m)) ~ m)
        else:
            params += [("values", v) for v in self.values]
        params += [(k, getattr(self, k)) for k in ("min", "max") if getattr(self, k) is not None]
        for name, v in params:
            check_in_range(w, name, v, lo, hi, limit)
        if self.kind == "lognormal" and self.max is None:
            return dataclasses.replace(self, max=float(hi))
        return self

    # ---- constructors ---------------------------------------------------------------------------
    @classmethod
    def const(cls, value: float, **kw: Any) -> Dist:
        return cls(kind="const", value=float(value), **kw)

    @classmethod
    def uniform(cls, low: float, high: float, **kw: Any) -> Dist:
        return cls(kind="uniform", low=float(low), high=float(high), **kw)

    @classmethod
    def lognormal(cls, *, median: float | None = None, sigma: float | None = None, mean: float | None = None,
                  cv: float | None = None, **kw: Any) -> Dist:
        """By median + sigma (of the log), or by mean + cv (std / mean) of the unclipped distribution."""
        where = kw.get("where", "dist")
        if median is not None and sigma is not None and mean is None and cv is None:
            if not median > 0:
                raise SpecError(where, "median", median, "a positive number")
            return cls(kind="lognormal", mu=math.log(median), sigma=float(sigma), **kw)
        if mean is not None and cv is not None and median is None and sigma is None:
            if not mean > 0:
                raise SpecError(where, "mean", mean, "a positive number")
            if not cv >= 0:
                raise SpecError(where, "cv", cv, "a number >= 0")
            s2 = math.log1p(cv * cv)
            return cls(kind="lognormal", mu=math.log(mean) - s2 / 2, sigma=math.sqrt(s2), **kw)
        raise SpecError(where, "lognormal", {"median": median, "sigma": sigma, "mean": mean, "cv": cv},
                        "either median + sigma, or mean + cv")

    @classmethod
    def empirical(cls, values: list[float], weights: list[float] | None = None, **kw: Any) -> Dist:
        return cls(kind="empirical", values=tuple(float(v) for v in values),
                   weights=tuple(float(x) for x in (weights or ())), **kw)

    # ---- moments and sampling ----------------------------------------------------------------
    @property
    def median(self) -> float:
        """Median of the clipped continuous distribution (empirical: weighted median)."""
        if self.kind == "const":
            m = self.value
        elif self.kind == "uniform":
            m = (self.low + self.high) / 2
        elif self.kind == "lognormal":
            m = math.exp(self.mu)
        else:
            vals, p = self._empirical_arrays()
            order = np.argsort(vals)
            m = float(vals[order][np.searchsorted(np.cumsum(p[order]), 0.5)])
        return float(min(max(m, self.min if self.min is not None else -math.inf),
                         self.max if self.max is not None else math.inf))

    @property
    def mean(self) -> float:
        """Exact mean of the clipped (continuous) distribution."""
        lo = -math.inf if self.min is None else self.min
        hi = math.inf if self.max is None else self.max
        if self.kind == "const":
            return float(min(max(self.value, lo), hi))
        if self.kind == "empirical":
            vals, p = self._empirical_arrays()
            vals = np.rint(vals) if self.integer else vals
            return float(np.sum(np.clip(vals, lo, hi) * p))
        if self.kind == "uniform" and self.integer:      # discrete: every integer in [low, high] equally likely
            return _clipped_integer_uniform_mean(math.ceil(self.low), math.floor(self.high), lo, hi)
        if self.kind == "uniform":
            a, b = self.low, self.high
            if b == a:
                return float(min(max(a, lo), hi))
            c1, c2 = min(max(lo, a), b), min(max(hi, a), b)   # clip points moved inside [a, b]
            below = lo * (c1 - a) if c1 > a else 0.0
            above = hi * (b - c2) if c2 < b else 0.0
            return float((below + (c2 * c2 - c1 * c1) / 2 + above) / (b - a))
        # lognormal: E[clip(X, lo, hi)] = lo P(X<lo) + hi P(X>hi) + E[X; lo<X<hi]
        mu, s = self.mu, self.sigma
        if s == 0:
            return float(min(max(math.exp(mu), lo), hi))
        llo = math.log(lo) if lo > 0 else -math.inf
        lhi = math.log(hi) if hi < math.inf else math.inf
        z = lambda x: (x - mu) / s  # noqa: E731
        below = _phi(z(llo)) * (lo if lo > 0 else 0.0)
        above = (1.0 - _phi(z(lhi))) * (hi if hi < math.inf else 0.0)
        partial = math.exp(mu + s * s / 2) * (_phi(z(lhi) - s) - _phi(z(llo) - s))
        return float(below + above + partial)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n draws (float64; integer-valued when `integer`), clipped to [min, max]."""
        if self.kind == "const":
            x = np.full(n, float(self.value))
        elif self.kind == "uniform":
            if self.integer:
                x = rng.integers(math.ceil(self.low), math.floor(self.high) + 1, size=n).astype(np.float64)
            else:
                x = rng.uniform(self.low, self.high, size=n)
        elif self.kind == "lognormal":
            x = rng.lognormal(self.mu, self.sigma, size=n)
        else:
            vals, p = self._empirical_arrays()
            x = rng.choice(vals, size=n, p=p)
        if self.integer:
            x = np.rint(x)
        if self.min is not None or self.max is not None:
            x = np.clip(x, self.min, self.max)
        return x

    def _empirical_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        vals = np.asarray(self.values, dtype=np.float64)
        w = np.asarray(self.weights, dtype=np.float64) if self.weights else np.ones_like(vals)
        return vals, w / w.sum()

    def to_dict(self) -> dict[str, Any]:
        """The TOML inline-table form (round-trips through dist_from_dict)."""
        d: dict[str, Any] = {"kind": self.kind}
        if self.kind == "const":
            d["value"] = self.value
        elif self.kind == "uniform":
            d.update(low=self.low, high=self.high)
        elif self.kind == "lognormal":
            d.update(median=math.exp(self.mu), sigma=self.sigma)
        else:
            d["values"] = list(self.values)
            if self.weights:
                d["weights"] = list(self.weights)
        for k in ("min", "max"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.integer:
            d["integer"] = True
        return d


def _clipped_integer_uniform_mean(a: int, b: int, lo: float, hi: float) -> float:
    """E[clip(K, lo, hi)] for K uniform on the integers a..b, in closed form (no array of b - a + 1 values)."""
    n = b - a + 1
    below = min(max(math.ceil(lo) - a, 0), n) if lo > -math.inf else 0       # integers < lo: each counts lo
    above = min(max(b - math.floor(hi), 0), n) if hi < math.inf else 0      # integers > hi: each counts hi
    middle = n - below - above
    total = below * (lo if below else 0.0) + above * (hi if above else 0.0)
    if middle > 0:
        first = a + below                                                    # the middle run first .. first+middle-1
        total += middle * (2 * first + middle - 1) / 2
    return float(total / n)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def dist_from_dict(raw: Any, where: str = "dist") -> Dist:
    """Build a Dist from its TOML table (a bare number is a const)."""
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return Dist.const(float(raw), where=where)
    if not isinstance(raw, dict):
        raise SpecError(where, "<dist>", raw, "a number or a table with kind = " + " | ".join(DIST_KINDS))
    kind = get_str(where, raw, "kind", allowed=DIST_KINDS)
    common = ("kind", "min", "max", "integer", "source", "note")
    per_kind = {"const": ("value",), "uniform": ("low", "high"), "lognormal": ("median", "sigma", "mean", "cv"),
                "empirical": ("values", "weights")}
    check_keys(where, raw, (*common, *per_kind[kind]))
    kw: dict[str, Any] = {"where": where, "integer": get_bool(where, raw, "integer", default=False)}
    for k in ("min", "max"):
        if k in raw:
            kw[k] = get_float(where, raw, k)
    if kind == "const":
        return Dist.const(get_float(where, raw, "value"), **kw)
    if kind == "uniform":
        return Dist.uniform(get_float(where, raw, "low"), get_float(where, raw, "high"), **kw)
    if kind == "lognormal":
        opt = {k: get_float(where, raw, k, lo=0.0) for k in ("median", "sigma", "mean", "cv") if k in raw}
        return Dist.lognormal(**opt, **kw)
    values = raw.get("values")
    weights = raw.get("weights", [])
    for key, lst in (("values", values), ("weights", weights)):
        if not isinstance(lst, list) or not all(_finite(v) for v in lst):
            raise SpecError(where, key, lst, "a list of numbers")
    return Dist.empirical(values, weights, **kw)
