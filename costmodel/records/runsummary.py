"""What a run log says in numbers: the summary the twin prints, `mixfleet compare` / `fidelity` put
side by side, calibration checks and the UI shows.

`summarize(runlog)` reduces the four tables of a run log (see runlog.py) to one `RunSummary`;
`compare(a, b)` lays two summaries side by side with absolute and relative differences.
Pure pandas / numpy, so the simulated and the real world are summarized by the very same code.

Definitions (the run clock starts at 0; seconds are simulated for the twin, wall for the runner):
- elapsed_s: end of the last update (0 without updates).
- time per update: the intervals between consecutive update ends on the update loop (`loop_clock`), the
  first measured from the loop's start (so it includes filling the pipeline); mean, p50, p95 (numpy linear
  percentiles). For a twin log the loop starts at 0; for a real run it starts after the run's start-up (Ray,
  samplers), and a stopped-and-resumed run counts each segment's loop only: the stop, the wait and the restart
  are in elapsed_s and outside_loop_s, never in a time per update (issue 26: the card and `fidelity` say one
  figure).
- cost per update: the last update's cumulative cost / updates (sampler, trainer, sandbox, total; a run without
  sandboxes has 0 sandbox cost).
- sandbox_wait_share: the trained episodes' pool waits over their waits + sandbox time (updates' sandbox_wait_s /
  (sandbox_wait_s + sandbox_s), summed over updates); NaN without sandboxes.
- sandbox use from the trajectories (`sandbox_use`: real and twin logs alike, the fidelity check's figures): per
  logged episode with sandboxes, its pool wait (the sum of `pool_wait_s`, a runner's; else `sandbox_wait_s`, the
  twin's) and its sandbox-seconds, its span less that wait (end_s - start_s - wait: the episode's clock starts
  before it asks for its sandbox and stops after the last one closes); the wait share is waits / (waits +
  sandbox-seconds), the sandbox cost per update sandbox-seconds x a price per sandbox-hour / 3600 / updates.
- staleness_mean: token-weighted mean of the updates' per-token mean staleness (versions);
  staleness_p95: mean over updates of each update's p95; staleness_max: max over updates.
- trainer_idle_share: 1 - sum(train_step_s + weight_sync_s) / the loop's seconds (loop_s: elapsed_s less
  outside_loop_s).
- tokens_per_s: generated tokens (groups table; trajectories if it is empty) / elapsed_s.
- utilization: replicas_up-weighted mean of the groups' utilization.
- kl_k1, kl_k3, masked_share, extreme_share (outside [0.2, 5]): token-weighted means over
  updates, NaN-skipping (NaN if no update has the metric).
- per group: share of samples (its samples / all samples over the run), tokens/s, utilization,
  kl_k3 and extreme share (weighted by tokens_trained, or samples when tokens are unknown), cost.
- finish_reasons: share of trajectories per reason (every reason listed, 0 when absent).
- reward trend: reward_first / reward_last are the mean reward_mean of the first / last
  max(1, updates // 10) updates; reward_slope_per_update is a least-squares slope over updates.

Steady state (`steady_state`, the standard output analysis of a simulation, applied to real logs alike):
- pipeline fill: first_update_s, start to the first update's end (the first interval, always excluded).
- warm-up: the remaining per-update series (interval between update ends, cost per update = the increment
  of the cumulative sampler + trainer + sandbox cost, per-update staleness_mean) are each truncated by MSER-5 (White
  1997: the truncation point d minimizing the variance of the mean of what remains, sum((z - mean)^2) /
  (k - d)^2 over batch means z of 5 updates, d <= k / 2; batches of 1 when fewer than 20 updates remain);
  the run's warm-up is the largest of the three (warmup_updates counts the first update too).
- steady_*: the mean of the updates after the warm-up and its 95% confidence half-width by batch means
  (b = min(10, max(2, n // 2)) consecutive batches of n // b updates, the leading remainder dropped from the
  batches; half-width t(0.975, b - 1) x sd(batch means) / sqrt(b); NaN with fewer than 2 updates).
  steady_tokens_per_s = trained tokens / time over those updates (a ratio, no interval).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from mixfleet.costmodel.records.runlog import FINISH_REASONS, RunLog, extreme_shares

_NAN = float("nan")


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    run_id: str
    source: str                              # "twin" | "runner"
    clock: str                               # "simulated" | "wall": what the seconds below are
    updates: int
    trajectories: int
    elapsed_s: float
    outside_loop_s: float                    # elapsed_s not on the update loop: start-ups, a stop and its restart
    segments: int                            # the run's segments (1 + resumes with an update after them)
    wall_s: float                            # header's wall_s if given (twin: how long the simulation took), else
                                             # elapsed_s for the runner, NaN for the twin
    time_per_update_mean_s: float
    time_per_update_p50_s: float
    time_per_update_p95_s: float
    first_update_s: float
    cost_sampler_per_update_usd: float
    cost_trainer_per_update_usd: float
    cost_per_update_usd: float
    cost_total_usd: float
    staleness_mean: float                    # versions
    staleness_p95: float
    staleness_max: float
    trainer_idle_share: float
    tokens_generated: int
    tokens_trained: int
    tokens_per_s: float
    utilization: float
    kl_k1: float
    kl_k3: float
    masked_share: float
    extreme_share: float
    reward_first: float
    reward_last: float
    reward_slope_per_update: float
    pass_at_k_last: float
    restarts: int
    turns_mean: float
    finish_reasons: dict[str, float] = field(default_factory=dict)
    group_share_of_samples: dict[str, float] = field(default_factory=dict)
    group_tokens_per_s: dict[str, float] = field(default_factory=dict)
    group_utilization: dict[str, float] = field(default_factory=dict)
    group_replicas_mean: dict[str, float] = field(default_factory=dict)
    group_kl_k3: dict[str, float] = field(default_factory=dict)
    group_extreme_share: dict[str, float] = field(default_factory=dict)
    group_staleness_mean: dict[str, float] = field(default_factory=dict)
    group_cost_usd: dict[str, float] = field(default_factory=dict)
    # steady state (see the module docstring): after the pipeline fill (first_update_s) and the warm-up
    warmup_updates: int = 0                  # updates before the steady state (the first one included)
    steady_updates: int = 0                  # updates the steady-state figures average
    steady_time_per_update_s: float = _NAN
    steady_time_per_update_ci_s: float = _NAN       # 95% half-width (batch means)
    steady_cost_per_update_usd: float = _NAN
    steady_cost_per_update_ci_usd: float = _NAN
    steady_cost_sampler_per_update_usd: float = _NAN
    steady_cost_sampler_per_update_ci_usd: float = _NAN
    steady_staleness_mean: float = _NAN
    steady_staleness_ci: float = _NAN
    steady_tokens_per_s: float = _NAN
    # sandboxes (0 / NaN for a run without them)
    cost_sandbox_per_update_usd: float = 0.0
    sandbox_wait_share: float = _NAN          # the trained episodes' pool waits / (waits + sandbox time)
    steady_cost_sandbox_per_update_usd: float = _NAN
    steady_cost_sandbox_per_update_ci_usd: float = _NAN

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (per-group and finish-reason values as nested dicts); NaN stays NaN."""
        return asdict(self)

    def flat(self) -> dict[str, float]:
        """Numeric values only, nested dicts flattened as `name[key]` (e.g. `group_share_of_samples[h100-fp8]`)."""
        out: dict[str, float] = {}
        for k, v in asdict(self).items():
            if isinstance(v, Mapping):
                for kk, vv in v.items():
                    out[f"{k}[{kk}]"] = float(vv)
            elif isinstance(v, bool | int | float | np.integer | np.floating):
                out[k] = float(v)
        return out

    @property
    def groups(self) -> list[str]:
        return list(self.group_share_of_samples)


def _wmean(values: Any, weights: Any) -> float:
    """Weighted mean skipping NaN values; falls back to the plain mean when the weights sum to 0."""
    v = np.asarray(values, dtype=float)
    w = np.asarray(weights, dtype=float)
    ok = ~np.isnan(v)
    if not ok.any():
        return _NAN
    v, w = v[ok], w[ok]
    if np.nansum(w) > 0:
        return float(np.nansum(v * w) / np.nansum(w))
    return float(v.mean())


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else _NAN


def _head_tail_mean(values: np.ndarray, tail: bool) -> float:
    if not len(values):
        return _NAN
    k = max(1, len(values) // 10)
    part = values[-k:] if tail else values[:k]
    part = part[~np.isnan(part)]
    return float(part.mean()) if len(part) else _NAN


MSER_BATCH = 5          # MSER-5: warm-up truncation on batch means of 5 updates


@dataclass(frozen=True, kw_only=True)
class SteadyEstimate:
    """One metric's steady-state mean with its 95% confidence half-width (batch means)."""
    mean: float
    half_width: float                        # NaN with fewer than 2 observations
    n: int                                   # observations averaged
    batches: int

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def contains(self, x: float) -> bool:
        return bool(self.low <= x <= self.high)


def mser_truncation(values: Any, batch: int = MSER_BATCH) -> int:
    """MSER-m warm-up truncation: how many leading observations to delete. The series is cut into batches of
    `batch` (the trailing remainder only joins the mean later); d batches are deleted where
    sum((z_j - mean(z_d:))^2) / (k - d)^2 is smallest, d <= k / 2 (ties: the smallest d). With fewer than
    4 batches of `batch` it falls back to batches of 1 (MSER); under 4 observations nothing is deleted."""
    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)] if np.isnan(x).any() else x
    m = batch if len(x) >= 4 * batch else 1
    k = len(x) // m
    if k < 4:
        return 0
    z = x[:k * m].reshape(k, m).mean(axis=1)
    best_d, best = -1, math.inf
    for d in range(k // 2 + 1):
        rest = z[d:]
        stat = float(((rest - rest.mean()) ** 2).sum()) / len(rest) ** 2
        if best_d < 0 or stat < best * (1.0 - 1e-12):
            best_d, best = d, stat
    return best_d * m


def batch_means(values: Any, max_batches: int = 10) -> SteadyEstimate:
    """Mean of `values` and its 95% half-width by batch means: b = min(max_batches, max(2, n // 2)) batches
    of n // b consecutive values (the leading remainder left out of the batches, not of the mean)."""
    from scipy.special import stdtrit  # = scipy.stats.t.ppf, bit for bit, without importing scipy.stats (0.6 s)

    x = np.asarray(values, dtype=float)
    x = x[~np.isnan(x)]
    n = len(x)
    if n == 0:
        return SteadyEstimate(mean=_NAN, half_width=_NAN, n=0, batches=0)
    if n < 2:
        return SteadyEstimate(mean=float(x.mean()), half_width=_NAN, n=n, batches=n)
    b = min(max_batches, max(2, n // 2))
    size = n // b
    z = x[n - b * size:].reshape(b, size).mean(axis=1)
    half = float(stdtrit(b - 1, 0.975) * z.std(ddof=1) / math.sqrt(b))
    return SteadyEstimate(mean=float(x.mean()), half_width=half, n=n, batches=b)


@dataclass(frozen=True, kw_only=True)
class SteadyState:
    """A run's steady state: the pipeline fill, the warm-up MSER-5 found, and the estimates after it."""
    fill_s: float                            # start to the first update's end
    warmup_updates: int                      # updates before the steady state (the first one included)
    time_per_update_s: SteadyEstimate
    cost_per_update_usd: SteadyEstimate
    cost_sampler_per_update_usd: SteadyEstimate
    staleness: SteadyEstimate
    cost_sandbox_per_update_usd: SteadyEstimate   # the sandbox part of cost_per_update_usd (0 without sandboxes)
    tokens_per_s: float                      # trained tokens / time over the steady updates


def steady_state(updates: pd.DataFrame, start_s: float = 0.0) -> SteadyState:
    """The steady state of an `updates` table (run log columns end_s, cost_sampler_usd, cost_trainer_usd,
    staleness_mean, tokens), sorted by version; intervals are measured from `start_s`. See the module docstring."""
    up = updates.sort_values("version", kind="stable")
    n = len(up)
    nan = SteadyEstimate(mean=_NAN, half_width=_NAN, n=0, batches=0)
    if n == 0:
        return SteadyState(fill_s=_NAN, warmup_updates=0, time_per_update_s=nan, cost_per_update_usd=nan,
                           cost_sandbox_per_update_usd=nan,
                           cost_sampler_per_update_usd=nan, staleness=nan, tokens_per_s=_NAN)
    ends = up["end_s"].to_numpy(dtype=float)
    iv = np.diff(ends, prepend=start_s)
    cs = np.nan_to_num(up["cost_sampler_usd"].to_numpy(dtype=float))
    ct = np.nan_to_num(up["cost_trainer_usd"].to_numpy(dtype=float))
    cb = np.nan_to_num(up["cost_sandbox_usd"].to_numpy(dtype=float)) if "cost_sandbox_usd" in up else np.zeros(n)
    cost_s = np.diff(cs, prepend=0.0)
    cost_b = np.diff(cb, prepend=0.0)
    cost = cost_s + np.diff(ct, prepend=0.0) + cost_b
    stale = up["staleness_mean"].to_numpy(dtype=float)
    tokens = up["tokens"].to_numpy(dtype=float)
    d = 1 + max(mser_truncation(x[1:]) for x in (iv, cost, stale))  # the first update is the pipeline fill
    keep = slice(d, None)
    time_kept = float(iv[keep].sum())
    return SteadyState(
        fill_s=float(iv[0]), warmup_updates=min(d, n), time_per_update_s=batch_means(iv[keep]),
        cost_per_update_usd=batch_means(cost[keep]), cost_sampler_per_update_usd=batch_means(cost_s[keep]),
        staleness=batch_means(stale[keep]), cost_sandbox_per_update_usd=batch_means(cost_b[keep]),
        tokens_per_s=float(tokens[keep].sum()) / time_kept if time_kept > 0 else _NAN)


@dataclass(frozen=True, kw_only=True)
class SandboxUse:
    """The sandboxes of a run log's logged episodes (`sandbox_use`): how many held one, their pool waits and
    their sandbox-seconds, summed."""
    episodes: int
    wait_s: float
    held_s: float

    @property
    def wait_share(self) -> float:
        """Pool waits / (waits + sandbox-seconds); NaN without sandboxes."""
        total = self.wait_s + self.held_s
        return self.wait_s / total if self.episodes and total > 0 else _NAN

    def cost_per_update_usd(self, usd_per_hour: float, updates: int) -> float:
        """The sandbox-seconds priced at `usd_per_hour` per sandbox, per update (NaN without updates)."""
        return self.held_s * usd_per_hour / 3600.0 / updates if updates > 0 else _NAN


def _episode_wait(row: Any) -> float:
    """One trajectory's pool wait: the sum of its `pool_wait_s` list (runner), else `sandbox_wait_s` (twin);
    NaN when it has neither (no sandboxes)."""
    waits = row.get("pool_wait_s")
    if waits is not None and not (isinstance(waits, float) and math.isnan(waits)):
        arr = np.asarray(waits, dtype=np.float64)
        if len(arr):
            return float(np.nansum(arr))
    w = row.get("sandbox_wait_s", _NAN)
    return float(w) if w is not None and math.isfinite(float(w)) else _NAN


def sandbox_use(trajectories: pd.DataFrame) -> SandboxUse:
    """`SandboxUse` of a run log's trajectories (the module docstring's definition): each episode with a pool
    wait recorded (one with sandboxes) counts its wait and its span less the wait."""
    waits = held = 0.0
    n = 0
    for row in trajectories.to_dict("records"):
        w = _episode_wait(row)
        if not math.isfinite(w):
            continue
        n += 1
        waits += w
        held += max(float(row["end_s"]) - float(row["start_s"]) - w, 0.0)
    return SandboxUse(episodes=n, wait_s=waits, held_s=held)


def summarize(runlog: RunLog | str | os.PathLike[str]) -> RunSummary:
    """Reduce a run log (or its folder) to a RunSummary. See the module docstring for definitions."""
    log = runlog if isinstance(runlog, RunLog) else RunLog.open(runlog)
    up = log.updates.sort_values("version", kind="stable")
    gr = log.groups
    tr = log.trajectories
    n_up = len(up)
    source = str(log.header.get("source", ""))

    ends = up["end_s"].to_numpy(dtype=float)
    if n_up:
        elapsed = float(ends.max())
    elif len(tr):
        elapsed = float(tr["end_s"].max())
    else:
        elapsed = 0.0
    clock = loop_clock(log)
    intervals = clock.intervals
    loop_s = clock.span_s if n_up else elapsed

    cost_s = float(up["cost_sampler_usd"].iloc[-1]) if n_up else 0.0
    cost_t = float(up["cost_trainer_usd"].iloc[-1]) if n_up else 0.0
    cost_b = float(up["cost_sandbox_usd"].iloc[-1]) if n_up else 0.0
    waits, held = float(np.nansum(up["sandbox_wait_s"])), float(np.nansum(up["sandbox_s"]))
    wait_share = waits / (waits + held) if n_up and up["sandbox_s"].notna().any() and waits + held > 0 else _NAN
    per = (lambda x: x / n_up) if n_up else (lambda x: _NAN)

    tokens_w = up["tokens"].to_numpy(dtype=float)
    busy = float((up["train_step_s"] + up["weight_sync_s"]).sum())
    idle = 1.0 - busy / loop_s if loop_s > 0 else _NAN

    if len(gr):
        tokens_gen = int(gr["tokens_generated"].sum())
    else:
        tokens_gen = int(tr["generated_tokens"].sum()) if len(tr) else 0
    rate = (lambda x: x / elapsed) if elapsed > 0 else (lambda x: _NAN)

    extreme = extreme_shares(up).to_numpy(dtype=float)
    rewards = up["reward_mean"].to_numpy(dtype=float)
    ok = ~np.isnan(rewards)
    slope = float(np.polyfit(up["version"].to_numpy(dtype=float)[ok], rewards[ok], 1)[0]) if ok.sum() >= 2 else _NAN
    pak = up["pass_at_k"].to_numpy(dtype=float)
    pak = pak[~np.isnan(pak)]

    wall = log.header.get("wall_s")
    if wall is not None:
        wall_s = float(wall)
    else:
        wall_s = elapsed if source == "runner" else _NAN

    if len(tr):
        counts = tr["finish_reason"].value_counts()
        finish = {r: float(counts.get(r, 0)) / len(tr) for r in FINISH_REASONS}
    else:
        finish = {r: 0.0 for r in FINISH_REASONS}

    g_share: dict[str, float] = {}
    g_tps: dict[str, float] = {}
    g_util: dict[str, float] = {}
    g_rep: dict[str, float] = {}
    g_kl: dict[str, float] = {}
    g_ext: dict[str, float] = {}
    g_stale: dict[str, float] = {}
    g_cost: dict[str, float] = {}
    utilization = _NAN
    if len(gr):
        total_samples = float(gr["samples"].sum())
        utilization = _wmean(gr["utilization"], gr["replicas_up"])
        for name, g in gr.groupby("group", sort=True):
            name = str(name)
            g_share[name] = float(g["samples"].sum()) / total_samples if total_samples > 0 else _NAN
            g_tps[name] = rate(float(g["tokens_generated"].sum()))
            g_util[name] = _wmean(g["utilization"], g["replicas_up"])
            g_rep[name] = float(g["replicas_up"].mean())
            w = g["tokens_trained"] if float(g["tokens_trained"].sum()) > 0 else g["samples"]
            g_kl[name] = _wmean(g["kl_k3"], w)
            g_ext[name] = _wmean(g["extreme_share"], w)
            g_stale[name] = _wmean(g["staleness_mean"], w)
            g_cost[name] = float(g["cost_usd"].sum())

    ss = steady_state(up)
    return RunSummary(
        warmup_updates=ss.warmup_updates, steady_updates=ss.time_per_update_s.n,
        steady_time_per_update_s=ss.time_per_update_s.mean, steady_time_per_update_ci_s=ss.time_per_update_s.half_width,
        steady_cost_per_update_usd=ss.cost_per_update_usd.mean,
        steady_cost_per_update_ci_usd=ss.cost_per_update_usd.half_width,
        steady_cost_sampler_per_update_usd=ss.cost_sampler_per_update_usd.mean,
        steady_cost_sampler_per_update_ci_usd=ss.cost_sampler_per_update_usd.half_width,
        steady_staleness_mean=ss.staleness.mean, steady_staleness_ci=ss.staleness.half_width,
        steady_tokens_per_s=ss.tokens_per_s,
        run_id=log.run_id, source=source, clock="simulated" if source == "twin" else "wall",
        updates=n_up, trajectories=len(tr), elapsed_s=elapsed, wall_s=wall_s,
        outside_loop_s=max(0.0, elapsed - loop_s), segments=clock.segments,
        time_per_update_mean_s=float(intervals.mean()) if n_up else _NAN,
        time_per_update_p50_s=_pct(intervals, 50), time_per_update_p95_s=_pct(intervals, 95),
        first_update_s=float(intervals[0]) if n_up else _NAN,
        cost_sampler_per_update_usd=per(cost_s), cost_trainer_per_update_usd=per(cost_t),
        cost_per_update_usd=per(cost_s + cost_t + cost_b), cost_total_usd=cost_s + cost_t + cost_b,
        cost_sandbox_per_update_usd=per(cost_b), sandbox_wait_share=wait_share,
        steady_cost_sandbox_per_update_usd=ss.cost_sandbox_per_update_usd.mean,
        steady_cost_sandbox_per_update_ci_usd=ss.cost_sandbox_per_update_usd.half_width,
        staleness_mean=_wmean(up["staleness_mean"], tokens_w),
        staleness_p95=_wmean(up["staleness_p95"], np.ones(n_up)),
        staleness_max=float(np.nanmax(up["staleness_max"])) if n_up and up["staleness_max"].notna().any() else _NAN,
        trainer_idle_share=idle, tokens_generated=tokens_gen, tokens_trained=int(up["tokens"].sum()),
        tokens_per_s=rate(float(tokens_gen)), utilization=utilization,
        kl_k1=_wmean(up["kl_k1"], tokens_w), kl_k3=_wmean(up["kl_k3"], tokens_w),
        masked_share=_wmean(up["masked_share"], tokens_w), extreme_share=_wmean(extreme, tokens_w),
        reward_first=_head_tail_mean(rewards, tail=False), reward_last=_head_tail_mean(rewards, tail=True),
        reward_slope_per_update=slope, pass_at_k_last=float(pak[-1]) if len(pak) else _NAN,
        restarts=int(tr["restarts"].sum()) if len(tr) else 0,
        turns_mean=float(tr["turns"].mean()) if len(tr) else _NAN,
        finish_reasons=finish, group_share_of_samples=g_share, group_tokens_per_s=g_tps, group_utilization=g_util,
        group_replicas_mean=g_rep, group_kl_k3=g_kl, group_extreme_share=g_ext, group_staleness_mean=g_stale,
        group_cost_usd=g_cost,
    )


def _rel(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return _NAN
    if a == b:
        return 0.0
    if a == 0:
        return _NAN
    return (b - a) / abs(a)


def compare(a: RunSummary, b: RunSummary, labels: Sequence[str] = ("a", "b")) -> pd.DataFrame:
    """Two summaries side by side: one row per numeric metric (per-group values as `name[group]`), columns
    `metric`, labels[0], labels[1], `diff` (= b - a) and `rel_diff` (= (b - a) / |a|; 0 when equal, NaN when a
    is 0 or either is NaN). Metrics present in only one summary get NaN on the other side.
    For fidelity, pass the measured run as `a` so rel_diff is the prediction's relative error.
    `df.attrs` holds the run ids and sources."""
    if len(labels) != 2 or labels[0] == labels[1] or set(labels) & {"metric", "diff", "rel_diff"}:
        raise ValueError(f"compare: labels {tuple(labels)!r} must be two distinct names other than "
                         "'metric', 'diff', 'rel_diff'")
    fa, fb = a.flat(), b.flat()
    keys = list(fa) + [k for k in fb if k not in fa]
    va = [fa.get(k, _NAN) for k in keys]
    vb = [fb.get(k, _NAN) for k in keys]
    df = pd.DataFrame({
        "metric": keys, labels[0]: va, labels[1]: vb,
        "diff": [y - x for x, y in zip(va, vb, strict=True)],
        "rel_diff": [_rel(x, y) for x, y in zip(va, vb, strict=True)],
    })
    df.attrs = {"labels": tuple(labels), "run_ids": (a.run_id, b.run_id), "sources": (a.source, b.source),
                "clocks": (a.clock, b.clock)}
    return df


@dataclass(frozen=True, kw_only=True)
class LoopClock:
    """The update loop's seconds of a run log, start-up left out (what `fidelity` measures time per update on)."""
    intervals: np.ndarray                    # per update (version order): seconds since the previous update's end,
                                             # or for a segment's first update since that segment's loop started
    span_s: float                            # the loop's seconds, summed over the run's segments
    segments: int                            # 1 + the resumes that have an update after them


def loop_clock(runlog: RunLog | str | os.PathLike[str]) -> LoopClock:
    """Intervals between update ends measured on the update loop only, per run segment (issue 26).

    A resumed run's clock continues from its checkpoint, so each segment after a "resume" event pays its own
    start-up (Ray, samplers) on the run clock. A segment's loop starts: for the last segment, at header
    `elapsed - loop_s` (the runner writes `loop_s` for the segment it closes) when that falls inside it; else
    at the first logged trajectory that started in the segment (the loop's first prompts), or the segment's
    start when none did. A twin run log (one segment, no start-up) starts at 0."""
    log = runlog if isinstance(runlog, RunLog) else RunLog.open(runlog)
    up = log.updates.sort_values("version", kind="stable")
    ends = up["end_s"].to_numpy(dtype=np.float64)
    if not len(ends):
        return LoopClock(intervals=np.array([]), span_s=_NAN, segments=0)
    runner = log.header.get("source") == "runner"
    ev = log.events
    resumes = np.sort(ev.loc[ev["kind"] == "resume", "time_s"].to_numpy(dtype=np.float64)) if len(ev) else np.array([])
    seg = np.searchsorted(resumes, ends, side="left")             # resumes before each update's end
    tr = log.trajectories
    starts = tr["start_s"].to_numpy(dtype=np.float64) if len(tr) else np.array([])
    loop_s = log.header.get("loop_s")
    last_seg = int(seg.max())
    intervals, span = [], 0.0
    for k in sorted(set(seg.tolist())):
        e = ends[seg == k]
        lo = resumes[k - 1] if k > 0 else -math.inf
        hi = resumes[k] if k < len(resumes) else math.inf
        t0 = max(lo, 0.0)
        if not runner and k == 0:
            t0 = 0.0
        elif (k == last_seg and isinstance(loop_s, int | float) and math.isfinite(loop_s)
              and lo <= float(ends.max()) - float(loop_s) <= e[0]):
            t0 = float(ends.max()) - float(loop_s)
        else:
            inside = starts[(starts >= lo) & (starts < hi)]
            if len(inside):
                t0 = max(t0, float(inside.min()))
        t0 = min(t0, float(e[0]))
        intervals.append(np.diff(e, prepend=t0))
        span += float(e[-1]) - t0
    return LoopClock(intervals=np.concatenate(intervals), span_s=span, segments=len(intervals))
