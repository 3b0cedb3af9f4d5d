"""The mismatch the re-planner acts on (issue 27 item 6): KL and extreme share as a function of staleness, fitted
across one run's own range of staleness (its staleness-0 tokens against its stale ones), with stderr.

Rows shaped like a real tiny-cpu run's (runs/learning/c: KL ~3e-7 at staleness 0, ~0.01 at 2): the per-update form
kl0 (1 + g s) fits them with its growth at the cap of 10 per version and a level at staleness 0 set by the cap;
the split fit needs no cap and reports the line with its stderr.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from mixfleet.costmodel.calibration.mismatch_fit import (
    MAX_GROWTH_PER_VERSION,
    _growth_fit,
    _mismatch_split,
    stale_kl_line,
)
from mixfleet.costmodel.calibration.record import Fitted
from mixfleet.costmodel.specs.mismatch import mismatch_prior

PRIOR = mismatch_prior("CPU-2core", "bf16", "bf16")


def rows(level: float, slope: float, ext_ratio: float, seed: int = 0) -> pd.DataFrame:
    """Update 1 on-policy, update 2 at staleness 1, then 18 updates at staleness 2 (KL with 30% noise)."""
    rng = np.random.default_rng(seed)
    st = np.array([0.0, 1.0] + [2.0] * 18)
    n = np.full(len(st), 1400)
    kl = (level + slope * st) * np.where(st > 0, rng.lognormal(0.0, 0.3, len(st)), 1.0)
    return pd.DataFrame({"version": np.arange(1, len(st) + 1), "tokens_trained": n, "staleness_mean": st,
                         "tokens_on_policy": np.where(st == 0, n, 0), "kl_k3": kl,
                         "kl_k3_on_policy": np.where(st == 0, kl, np.nan), "extreme_share": ext_ratio * kl})


def kl_at(v0: Fitted, g: Fitted, s: float) -> float:
    return v0.value * (1 + g.value * s)


def test_staleness_dominated_mismatch_is_fitted_from_one_run() -> None:
    gr = rows(level=3e-7, slope=0.005, ext_ratio=0.13)
    kl0, klg, ex0, exg = _mismatch_split(gr, PRIOR)
    measured = float((gr["kl_k3"] * gr["tokens_trained"])[gr["staleness_mean"] == 2].sum()
                     / gr["tokens_trained"][gr["staleness_mean"] == 2].sum())
    assert kl_at(kl0, klg, 2.0) == pytest.approx(measured, rel=0.10)
    assert kl_at(kl0, klg, 1.0) == pytest.approx(measured / 2, rel=0.25)      # half the drift at half the staleness
    assert kl0.value < 0.05 * measured and np.isfinite(kl0.stderr) and np.isfinite(klg.stderr)
    assert kl_at(ex0, exg, 2.0) == pytest.approx(0.13 * measured, rel=0.10)    # extreme share follows the KL
    # the per-update form it replaces puts the level at staleness 0 where its growth cap (10 per version) lets it:
    # ~5% of the KL at staleness 2, 1,500x the measured on-policy KL; the split keeps it at its 1% floor
    old0, oldg = _growth_fit(gr["staleness_mean"].to_numpy(float), gr["kl_k3"].to_numpy(float),
                                 gr["tokens_trained"].to_numpy(float), PRIOR.kl_k3, PRIOR.growth_per_staleness, "")
    assert oldg.value == pytest.approx(MAX_GROWTH_PER_VERSION) and old0.value > 3 * kl0.value


def test_a_kept_level_says_so_first() -> None:
    """Issue 44: the calibration table cut the note off, and what showed ("kl(s) = 3e-07 ...") contradicted the
    row's value (the level kept at 1 % of the KL at the run's staleness, said only at the note's end)."""
    kl0, _, _, _ = _mismatch_split(rows(level=3e-7, slope=0.005, ext_ratio=0.13), PRIOR)
    assert kl0.note.startswith(f"kl0 = {kl0.value:.3g}: kept at 1% of kl at the run's mean staleness"), kl0.note
    exact = rows(level=4e-3, slope=0.0, ext_ratio=0.2)
    exact["kl_k3"] = 4e-3
    exact["kl_k3_on_policy"] = np.where(exact["staleness_mean"] == 0, 4e-3, np.nan)
    kl0, _, _, _ = _mismatch_split(exact, PRIOR)
    assert kl0.note.startswith("kl(s) = 0.004 (+- ") and " + 0 (+- " in kl0.note, kl0.note   # no 7e-18 for 0


def test_a_format_level_and_its_growth_are_recovered() -> None:
    level, g = 4e-3, 0.05   # the priors' form: kl0 (1 + g s), no noise
    gr = rows(level=level, slope=level * g, ext_ratio=0.2)
    gr["kl_k3"] = level * (1 + g * gr["staleness_mean"])
    gr["kl_k3_on_policy"] = np.where(gr["staleness_mean"] == 0, gr["kl_k3"], np.nan)
    gr["extreme_share"] = 0.2 * gr["kl_k3"]
    kl0, klg, ex0, exg = _mismatch_split(gr, PRIOR)
    assert kl0.value == pytest.approx(level, rel=1e-6) and klg.value == pytest.approx(g, rel=1e-4)
    assert ex0.value == pytest.approx(0.2 * level, rel=1e-6) and exg.value == pytest.approx(g, rel=1e-4)


def test_without_staleness_zero_tokens_the_caller_falls_back() -> None:
    gr = rows(level=1e-3, slope=1e-3, ext_ratio=0.1).iloc[2:]   # only staleness-2 rows
    assert _mismatch_split(gr, PRIOR) is None


def movement_rows(rng: np.random.Generator, updates: int, staleness: int) -> pd.DataFrame:
    """A run whose stale KL is the trainer's movement over the versions a token spans: step t moves the policy by
    m_t (i.i.d. lognormal), a token `staleness` versions stale at update v carries m_(v-s+1) + ... + m_v, so one
    large step raises the next `staleness` updates' KL together (a moving average, as in the real runs)."""
    m = rng.lognormal(0.0, 0.6, updates + staleness)
    st = np.minimum(np.arange(updates), staleness).astype(float)
    kl = np.array([3e-7 if s == 0 else 0.0025 * m[i:i + int(s)].sum() for i, s in enumerate(st)])
    n = np.full(updates, 1400)
    return pd.DataFrame({"version": np.arange(1, updates + 1), "tokens_trained": n, "staleness_mean": st,
                         "tokens_on_policy": np.where(st == 0, n, 0), "kl_k3": kl,
                         "kl_k3_on_policy": np.where(st == 0, kl, np.nan), "extreme_share": 0.1 * kl})


def test_the_robust_stderr_is_the_spread_of_another_run_where_the_independent_one_is_not() -> None:
    # 300 runs of one process: the spread of their KL at staleness 3 is what a prediction of the next run carries
    rng = np.random.default_rng(1)
    lines = [stale_kl_line(movement_rows(rng, updates=40, staleness=3)) for _ in range(300)]
    assert all(ln is not None and ln.lag == 2 for ln in lines)
    values = np.array([ln.value for ln in lines])
    spread = values.std(ddof=1)
    robust = np.median([ln.stderr_robust for ln in lines]) / spread
    independent = np.median([ln.stderr for ln in lines]) / spread
    assert 0.75 <= robust <= 1.25, robust          # measured 0.86
    assert independent < 0.65, independent          # measured 0.53: consecutive updates treated as independent


def test_pooling_two_runs_narrows_the_robust_stderr() -> None:
    # two runs pooled (versions repeat; lags stay within a run): the stderr shrinks about like 1 / sqrt(2)
    rng = np.random.default_rng(2)
    a, b = movement_rows(rng, 40, 2), movement_rows(rng, 40, 2)
    one = stale_kl_line(a.assign(_run=0))
    both = stale_kl_line(pd.concat([a.assign(_run=0), b.assign(_run=1)], ignore_index=True))
    assert one is not None and both is not None
    assert 0.4 < both.stderr_robust / one.stderr_robust < 1.0
