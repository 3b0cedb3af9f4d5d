"""Mismatch priors: expected sampler-trainer KL and extreme-ratio share per (accelerator, precision, KV dtype).

Read from data/mismatch.toml (rules with "*" wildcards; the most specific match wins), with the seed's
figures where it gives them and our estimates elsewhere. Both values grow linearly with staleness.
The planner discounts a group's samples by its extreme share; calibration replaces the priors.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.paths import data_path
from mixfleet.costmodel.tomlread import check_keys, get_bool, get_float, get_int, get_str, normalize_name, read_toml

WILDCARD = "*"


@dataclass(frozen=True, kw_only=True)
class MismatchPrior:
    accelerator: str                 # the rule's accelerator ("*" = any)
    precision: str
    kv_dtype: str
    kl_k3: float                     # mean per-token KL (k3 estimator) at staleness 0
    extreme_share: float             # share of tokens with ratio outside the band, at staleness 0
    growth_per_staleness: float      # relative growth per version of staleness
    band: tuple[float, float] = (0.2, 5.0)
    estimate: bool = True
    source: str = ""

    def __post_init__(self) -> None:
        where = f"mismatch prior {self.accelerator}/{self.precision}/{self.kv_dtype}"
        if not self.kl_k3 >= 0:
            raise SpecError(where, "kl_k3", self.kl_k3, "a number >= 0")
        if not 0 <= self.extreme_share <= 1:
            raise SpecError(where, "extreme_share", self.extreme_share, "a share in [0, 1]")
        if not self.growth_per_staleness >= 0:
            raise SpecError(where, "growth_per_staleness", self.growth_per_staleness, "a number >= 0")

    def kl_at(self, staleness: float) -> float:
        """KL at a given staleness (versions behind the trainer)."""
        return self.kl_k3 * (1.0 + self.growth_per_staleness * max(staleness, 0.0))

    def extreme_share_at(self, staleness: float) -> float:
        """Extreme-ratio share at a given staleness (capped at 1)."""
        return min(1.0, self.extreme_share * (1.0 + self.growth_per_staleness * max(staleness, 0.0)))


@dataclass(frozen=True, kw_only=True)
class MismatchTable:
    priors: tuple[MismatchPrior, ...]
    source_path: str = ""

    def lookup(self, accelerator: Any, precision: Any, kv_dtype: Any = "fp8_e4m3") -> MismatchPrior:
        """The most specific rule matching the names (objects with .name are accepted)."""
        names = [_name(x) for x in (accelerator, precision, kv_dtype)]
        best, best_score = None, -1
        for p in self.priors:
            score = 0
            for i, (rule, want) in enumerate(zip((p.accelerator, p.precision, p.kv_dtype), names, strict=True)):
                if rule == WILDCARD:
                    continue
                if normalize_name(rule) != normalize_name(want):
                    score = -1
                    break
                score += (4, 2, 1)[i]
            if score > best_score:
                best, best_score = p, score
        if best is None:
            known = sorted({f"{p.accelerator}/{p.precision}/{p.kv_dtype}" for p in self.priors})
            raise SpecError(self.source_path or "mismatch priors", "accelerator/precision/kv_dtype",
                            "/".join(names), "a combination matching a rule: " + ", ".join(known))
        return best


def _name(x: Any) -> str:
    return x if isinstance(x, str) else str(getattr(x, "name", x))


def load_mismatch_priors(path: str | Path | None = None) -> MismatchTable:
    """Load data/mismatch.toml (or the given file)."""
    if path is None:
        return _load_default()
    return _load(Path(path))


@lru_cache(maxsize=1)
def _load_default() -> MismatchTable:
    return _load(data_path("mismatch.toml"))


def _load(path: Path) -> MismatchTable:
    raw = read_toml(path)
    where = str(path)
    check_keys(where, raw, ("schema", "band", "growth_per_staleness", "priors"))
    get_int(where, raw, "schema", lo=1, hi=1)
    band = raw.get("band", [0.2, 5.0])
    if not (isinstance(band, list) and len(band) == 2 and all(isinstance(b, int | float) for b in band)
            and 0 < band[0] < 1 < band[1]):
        raise SpecError(where, "band", band, "[lo, hi] with 0 < lo < 1 < hi")
    growth = get_float(where, raw, "growth_per_staleness", lo=0.0)
    rules = raw.get("priors")
    if not isinstance(rules, list) or not rules:
        raise SpecError(where, "priors", rules, "a non-empty array of [[priors]] tables")
    out = []
    for i, r in enumerate(rules):
        w = f"{where} [[priors]] #{i + 1}"
        if not isinstance(r, dict):
            raise SpecError(where, f"priors[{i}]", r, "a table")
        check_keys(w, r, ("accelerator", "precision", "kv_dtype", "kl_k3", "extreme_share", "growth_per_staleness",
                          "estimate", "source"))
        out.append(MismatchPrior(
            accelerator=get_str(w, r, "accelerator"), precision=get_str(w, r, "precision"),
            kv_dtype=get_str(w, r, "kv_dtype"), kl_k3=get_float(w, r, "kl_k3", lo=0.0),
            extreme_share=get_float(w, r, "extreme_share", lo=0.0, hi=1.0),
            growth_per_staleness=get_float(w, r, "growth_per_staleness", default=growth, lo=0.0),
            band=(float(band[0]), float(band[1])), estimate=get_bool(w, r, "estimate", default=True),
            source=get_str(w, r, "source"),
        ))
    return MismatchTable(priors=tuple(out), source_path=where)


def mismatch_prior(accelerator: Any, precision: Any, kv_dtype: Any = "fp8_e4m3", *,
                   path: str | Path | None = None) -> MismatchPrior:
    """The prior for one (accelerator, precision, KV dtype); names or catalog objects."""
    return load_mismatch_priors(path).lookup(accelerator, precision, kv_dtype)
