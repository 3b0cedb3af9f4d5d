"""The tool side of a workload measured from real runs with a sandbox (the `repo` task): a workload TOML with
each distribution fitted, and every figure with a bootstrap interval.

What a run log's trajectories carry (costmodel/records/runlog.py, `TrajectoryRecord`): per reply its tool call's
seconds (`turn_tool_s`, NaN for a reply without a call) and the tokens appended after it (`turn_output_tokens`); per
episode its sandboxes' start seconds (`sandbox_start_s`), their pool waits (`pool_wait_s`) and every command's
seconds (`command_s`). The fit, over the episodes that ended normally (not "error", "aborted" or "restarted"):

- `tool_latency_s`: lognormal, maximum likelihood (median = exp(mean log x), sigma = std log x) over the tool calls a
  next reply followed (the twin's "latency after turn i", i < turns - 1; the final call, `submit` for the repo task,
  is the reward's time and is reported as `final_call_s`), clipped to the range seen;
- every lognormal written into the workload must reproduce the sample mean: when the clipped lognormal's mean is
  more than MEAN_TOLERANCE (10 %) off (values that are not one lognormal: a weak policy's calls that run no
  command take microseconds, its commands a second), the field is written as the measured values instead
  (empirical, at most EMPIRICAL_MAX_VALUES order statistics) and a note says so; the lognormal is still reported;
- `tool_output_tokens`: lognormal over the tokens appended after each reply a next reply followed (its tool output,
  or the nudge after a reply without a call: what the twin appends after turn i; integer, clipped to the range seen);
- `turns`: the replies per episode as measured (empirical; its mean and median with intervals, and the share of
  episodes that reached the run's turn cap, for which the distribution is censored);
- `prompt_tokens` (the first prompt: context tokens less every appended output and turn marker) and
  `reply_tokens` (an episode's generated tokens / its turns): lognormal;
- `sandbox_start_s`: lognormal over every sandbox start (the working sandbox and the fresh one of a submission);
- `command_s` (reported, not a workload field): lognormal over every sandbox command the run log holds (the
  model's commands, a task's setup, the tests on submit), the command-time distribution itself; `tool_latency_s`
  is the same per call as the twin charges it (a call without a command, e.g. an unknown tool, is ~0 s).
- `success_prob` (share of episodes with reward > 0) and `no_tool_call_prob` (share of replies without a call).

Uncertainty: a percentile bootstrap over episodes (episodes are resampled, so the commands of one episode stay
together), `BOOTSTRAP_SAMPLES` resamples, a `INTERVAL` (95 %) interval for each lognormal's median and sigma and
each share and mean. The pool waits are an outcome of the plan (its pool size), not of the workload: they are
reported (total, share of the episodes' seconds, how many waited) and not written into the workload.
The update shape (prompts x samples) is the run's plan's (its batcher), the context its workload's.

Pure numpy / pandas; reads run logs only through costmodel.records.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from mixfleet.costmodel.calibration.record import CalibrationError
from mixfleet.costmodel.calibration.workload_fit import EMPIRICAL_MAX_VALUES, subsample
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import RunLog
from mixfleet.costmodel.specs.dist import dist_from_dict
from mixfleet.costmodel.specs.workload import WorkloadSpec, load_workload, workload_from_dict

BOOTSTRAP_SAMPLES = 1000           # resamples of the episodes
INTERVAL = 0.95                    # the intervals' coverage
MIN_EPISODES = 4                   # episodes with the per-reply lists a fit needs
MIN_OBSERVATIONS = 4               # values of one lognormal field
LEFT_OUT = ("error", "aborted", "restarted")
MEAN_TOLERANCE = 0.10              # a lognormal is written when its clipped mean is this close to the sample mean
# the fits written into the workload (the others, command_s, are reported only)
WORKLOAD_FIELDS = ("tool_latency_s", "tool_output_tokens", "prompt_tokens", "reply_tokens", "sandbox_start_s")


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """One figure with its bootstrap interval [lo, hi] (INTERVAL coverage) and the observations behind it."""
    value: float
    lo: float
    hi: float
    n: int
    unit: str = ""

    def covers(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "lo": self.lo, "hi": self.hi, "n": self.n, "unit": self.unit}


@dataclass(frozen=True, kw_only=True)
class LognormalFit:
    """A lognormal fitted to values grouped by episode: median and sigma with intervals, the range seen."""
    median: Estimate
    sigma: Estimate
    mean: Estimate                     # the sample mean (not the model's), with its interval
    low: float                         # smallest value seen
    high: float                        # largest value seen
    episodes: int
    integer: bool = False
    values: tuple[float, ...] = field(default=(), repr=False, compare=False)   # every value fitted

    @property
    def mu(self) -> Estimate:
        """The lognormal's mu (mean of log x) = log(median), with the interval mapped the same way."""
        m = self.median
        return Estimate(value=math.log(m.value), lo=math.log(m.lo), hi=math.log(m.hi), n=m.n, unit=f"log {m.unit}")

    def model_mean(self) -> float:
        """The fitted lognormal's mean exp(mu + sigma^2 / 2), unclipped (compare with the sample `mean`)."""
        return self.median.value * math.exp(self.sigma.value ** 2 / 2.0)

    def dist(self) -> dict[str, Any]:
        """The workload TOML's inline table: the fitted lognormal clipped to the range seen."""
        d: dict[str, Any] = {"kind": "lognormal", "median": _r(self.median.value), "sigma": _r(self.sigma.value),
                             "min": _r(self.low), "max": _r(self.high)}
        if self.integer:
            d.update(min=float(math.floor(self.low)), max=float(math.ceil(self.high)), integer=True)
        return d

    def clipped_mean(self) -> float:
        """The mean of `dist()` (the lognormal clipped to the range seen), what the twin's draws average."""
        return dist_from_dict(self.dist(), where="fit").mean

    def fits_the_mean(self) -> bool:
        """The clipped lognormal's mean within MEAN_TOLERANCE of the sample mean (else the values are not one
        lognormal, e.g. calls that ran no command, microseconds, next to commands that take a second)."""
        return abs(self.clipped_mean() - self.mean.value) <= MEAN_TOLERANCE * abs(self.mean.value)

    def empirical(self) -> dict[str, Any]:
        """The workload TOML's inline table: the values seen (at most EMPIRICAL_MAX_VALUES evenly spaced order
        statistics of them)."""
        return {"kind": "empirical", "values": [_r(v) for v in subsample(np.asarray(self.values))],
                "min": _r(self.low), "max": _r(self.high), **({"integer": True} if self.integer else {})}

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median.to_dict(), "mu": self.mu.to_dict(), "clipped_mean": self.clipped_mean(),
                "fits_the_mean": self.fits_the_mean(), "sigma": self.sigma.to_dict(),
                "mean": self.mean.to_dict(), "model_mean": self.model_mean(),
                "min": self.low, "max": self.high, "episodes": self.episodes, "integer": self.integer}


def _r(x: float) -> float:
    return float(f"{x:.6g}")


def _bounds(samples: np.ndarray) -> tuple[float, float]:
    a = (1.0 - INTERVAL) / 2.0
    lo, hi = np.nanquantile(samples, [a, 1.0 - a])
    return float(lo), float(hi)


def _weights(episodes: int, rng: np.random.Generator) -> np.ndarray:
    """[BOOTSTRAP_SAMPLES, episodes] counts: how often each episode is drawn in each resample."""
    return rng.multinomial(episodes, np.full(episodes, 1.0 / episodes), size=BOOTSTRAP_SAMPLES).astype(np.float64)


def fit_lognormal(groups: Sequence[Sequence[float]], *, rng: np.random.Generator, unit: str = "",
                  integer: bool = False, where: str = "values") -> LognormalFit:
    """Maximum-likelihood lognormal of the positive values in `groups` (one sequence per episode), with an
    episode-bootstrap interval for its median, sigma and the sample mean. Values <= 0 are refused."""
    groups = [np.asarray(g, dtype=np.float64) for g in groups]
    groups = [g[np.isfinite(g)] for g in groups]
    groups = [g for g in groups if len(g)]
    x = np.concatenate(groups) if groups else np.zeros(0)
    if len(x) < MIN_OBSERVATIONS or len(groups) < 2:
        raise CalibrationError([f"{where}: {len(x)} values in {len(groups)} episodes (a lognormal fit needs "
                                f"{MIN_OBSERVATIONS} values in at least 2 episodes)"])
    if (x <= 0).any():
        raise SpecError("tool fit", where, float(x.min()), "values > 0 (a lognormal's support)")
    n = np.array([len(g) for g in groups], dtype=np.float64)
    s1 = np.array([np.log(g).sum() for g in groups])
    s2 = np.array([(np.log(g) ** 2).sum() for g in groups])
    sx = np.array([g.sum() for g in groups])
    mu = s1.sum() / n.sum()
    sigma = float(np.log(x).std())                          # the MLE, centred (no cancellation for a constant)
    w = _weights(len(groups), rng)
    nb = w @ n
    mub = (w @ s1) / nb
    sigb = np.sqrt(np.maximum((w @ s2) / nb - mub * mub, 0.0))
    meanb = (w @ sx) / nb
    m = len(x)
    return LognormalFit(
        median=Estimate(value=math.exp(mu), lo=math.exp(_bounds(mub)[0]), hi=math.exp(_bounds(mub)[1]), n=m,
                        unit=unit),
        sigma=Estimate(value=sigma, lo=_bounds(sigb)[0], hi=_bounds(sigb)[1], n=m),
        mean=Estimate(value=float(x.mean()), lo=_bounds(meanb)[0], hi=_bounds(meanb)[1], n=m, unit=unit),
        low=float(x.min()), high=float(x.max()), episodes=len(groups), integer=integer,
        values=tuple(float(v) for v in x))


def _share(hits: Sequence[float], totals: Sequence[float], rng: np.random.Generator, unit: str = "") -> Estimate:
    """sum(hits) / sum(totals) over episodes, with its episode-bootstrap interval."""
    h, t = np.asarray(hits, dtype=np.float64), np.asarray(totals, dtype=np.float64)
    w = _weights(len(h), rng)
    lo, hi = _bounds((w @ h) / np.maximum(w @ t, 1e-300))
    return Estimate(value=float(h.sum() / max(t.sum(), 1e-300)), lo=lo, hi=hi, n=int(t.sum()), unit=unit)


def _median_estimate(x: np.ndarray, rng: np.random.Generator, unit: str = "") -> Estimate:
    idx = rng.integers(0, len(x), size=(BOOTSTRAP_SAMPLES, len(x)))
    lo, hi = _bounds(np.median(x[idx], axis=1))
    return Estimate(value=float(np.median(x)), lo=lo, hi=hi, n=len(x), unit=unit)


@dataclass(frozen=True, kw_only=True)
class WorkloadFit:
    """What `fit_workload` measured: the workload table (TOML-ready), each figure with its interval, notes."""
    workload: dict[str, Any]
    fits: dict[str, LognormalFit]
    figures: dict[str, Estimate]
    counts: dict[str, int]
    pool: dict[str, Any]
    runs: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    def spec(self) -> WorkloadSpec:
        return workload_from_dict(self.workload, where=f"fitted workload {self.workload['name']}")

    def toml(self) -> str:
        """The workload TOML (data/workloads schema), its intervals as comments above the fields."""
        import tomli_w

        lines = [f"# Measured by `mixfleet calibrate --workload-out` from {', '.join(self.runs)}",
                 f"# ({self.counts['episodes']} episodes, {self.counts['tool_calls']} tool calls, "
                 f"{self.counts['sandbox_starts']} sandbox starts); {INTERVAL:.0%} episode-bootstrap intervals:"]
        for name, f in self.fits.items():
            lines.append(f"#   {name}: median {f.median.value:.4g} [{f.median.lo:.4g}, {f.median.hi:.4g}] "
                         f"{f.median.unit}, mu {f.mu.value:.4g} [{f.mu.lo:.4g}, {f.mu.hi:.4g}], "
                         f"sigma {f.sigma.value:.3g} [{f.sigma.lo:.3g}, {f.sigma.hi:.3g}], n {f.median.n}")
        for name, e in self.figures.items():
            lines.append(f"#   {name}: {e.value:.4g} [{e.lo:.4g}, {e.hi:.4g}] {e.unit}".rstrip())
        lines.extend(f"# note: {n}" for n in self.notes)
        return "\n".join(lines) + "\n" + tomli_w.dumps(self.workload)

    def save(self, path: str | os.PathLike[str]) -> Path:
        self.spec()                                   # never write a workload `simulate` would refuse
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(self.toml())
        tmp.replace(p)
        return p

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "fits": {k: f.to_dict() for k, f in self.fits.items()},
                "figures": {k: e.to_dict() for k, e in self.figures.items()}, "counts": self.counts,
                "pool": self.pool, "runs": list(self.runs), "notes": list(self.notes), "interval": INTERVAL,
                "bootstrap_samples": BOOTSTRAP_SAMPLES}


def _lists(tr: pd.DataFrame, name: str) -> list[np.ndarray]:
    return [np.asarray(v if v is not None else [], dtype=np.float64) for v in tr[name]]


def _episodes(logs: Sequence[RunLog]) -> tuple[pd.DataFrame, list[str]]:
    frames, notes = [], []
    for log in logs:
        tr = log.trajectories
        if "turn_tool_s" not in tr.columns:
            continue
        has = tr["turn_tool_s"].map(lambda v: v is not None)
        left = tr["finish_reason"].isin(LEFT_OUT)
        if int((has & left).sum()):
            notes.append(f"{log.directory}: {int((has & left).sum())} episodes that ended "
                         f"{'/'.join(LEFT_OUT)} left out")
        frames.append(tr[has & ~left])
    tr = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return tr, notes


def _base(header: dict[str, Any]) -> tuple[str, WorkloadSpec, int, int, int | None]:
    """The run's plan name, its workload, its update shape (the batcher's, else the workload's), its turn cap."""
    plan = header.get("plan") or {}
    try:
        base = load_workload(plan.get("workload") or "tiny-cpu")
    except SpecError as e:
        raise CalibrationError([f"the run's plan names a workload that does not load ({e})"]) from None
    batcher = ((plan.get("policies") or {}).get("batcher") or {})
    ppu = int(batcher.get("prompts_per_update", base.prompts_per_update))
    spp = int(batcher.get("samples_per_prompt", base.samples_per_prompt))
    emb = plan.get("embedded") or {}
    cap = (emb.get("task_options") or {}).get("max_turns") or emb.get("max_turns")
    return str(plan.get("name") or "run"), base, ppu, spp, int(cap) if cap else None


def fit_workload(runlogs: Iterable[str | os.PathLike[str] | RunLog], *, seed: int = 0,
                 name: str | None = None) -> WorkloadFit:
    """Fit the workload of one or more real runs (see the module doc). Raises CalibrationError naming what is
    missing when the logs hold too little (no per-reply lists: a log from before they were recorded)."""
    logs = [r if isinstance(r, RunLog) else RunLog.open(r) for r in runlogs]
    if not logs:
        raise CalibrationError(["run logs (none given)"])
    tr, notes = _episodes(logs)
    if len(tr) < MIN_EPISODES:
        raise CalibrationError([f"episodes with per-reply tool records: {len(tr)} in {len(logs)} run log(s), at "
                                f"least {MIN_EPISODES} needed (logs written before the run log recorded "
                                f"turn_tool_s have none)"])
    rng = np.random.default_rng(seed)
    plan_name, base, ppu, spp, cap = _base(logs[0].header)
    turns = tr["turns"].to_numpy(dtype=np.int64)
    call_s, out_tok = _lists(tr, "turn_tool_s"), _lists(tr, "turn_output_tokens")
    between = [c[:-1] for c in call_s]                      # calls a next reply followed
    lat = [c[np.isfinite(c)] for c in between]
    tok = [o[:-1][o[:-1] > 0] for o in out_tok]            # appended before a next reply (0: an abort)
    final = np.array([c[-1] for c, f in zip(call_s, tr["finish_reason"], strict=True)
                      if len(c) and f == "done" and np.isfinite(c[-1])])
    appended = np.array([o.sum() for o in out_tok])
    # the first prompt: the episode's context tokens less every appended output and each later turn's
    # `<|assistant|>` (the agent loop's chat format, runner/rollout/agent.py)
    first = tr["prompt_tokens"].to_numpy(dtype=np.float64) - appended - np.maximum(turns - 1, 0)
    reply = tr["generated_tokens"].to_numpy(dtype=np.float64) / np.maximum(turns, 1)
    starts = _lists(tr, "sandbox_start_s") if "sandbox_start_s" in tr else []
    fits = {"tool_latency_s": fit_lognormal(lat, rng=rng, unit="s", where="tool_latency_s (turn_tool_s)"),
            "tool_output_tokens": fit_lognormal(tok, rng=rng, unit="tokens", integer=True,
                                                where="tool_output_tokens (turn_output_tokens)"),
            "prompt_tokens": fit_lognormal([[v] for v in first], rng=rng, unit="tokens", integer=True,
                                           where="prompt_tokens"),
            "reply_tokens": fit_lognormal([[v] for v in reply[reply > 0]], rng=rng, unit="tokens", integer=True,
                                          where="reply_tokens")}
    if sum(len(s) for s in starts) >= MIN_OBSERVATIONS:
        fits["sandbox_start_s"] = fit_lognormal(starts, rng=rng, unit="s", where="sandbox_start_s")
    else:
        notes.append("no sandbox starts recorded (a task without a sandbox): the workload has no sandbox_start_s")
    t = turns.astype(np.float64)
    calls = np.array([np.isfinite(c).sum() for c in call_s], dtype=np.float64)
    figures = {
        "turns_mean": _share(t, np.ones_like(t), rng, "replies"),
        "turns_median": _median_estimate(t, rng, "replies"),
        "success_prob": _share((tr["reward"].to_numpy(dtype=np.float64) > 0).astype(np.float64), np.ones_like(t),
                               rng),
        "no_tool_call_prob": _share(t - calls, t, rng),
    }
    if cap:
        figures["turn_cap_share"] = _share((turns >= cap).astype(np.float64), np.ones_like(t), rng)
        if figures["turn_cap_share"].value > 0:
            notes.append(f"{figures['turn_cap_share'].value:.0%} of the episodes reached the turn cap ({cap}): "
                         f"their turns are censored there, as the twin's draws are (the measured values are used)")
    if len(final):
        figures["final_call_s"] = _median_estimate(final, rng, "s")
    cmd = _lists(tr, "command_s") if "command_s" in tr else []
    cmd_all = np.concatenate(cmd) if cmd else np.zeros(0)
    if len(cmd_all) >= MIN_OBSERVATIONS:
        fits["command_s"] = fit_lognormal(cmd, rng=rng, unit="s", where="command_s")
    else:
        notes.append(f"{len(cmd_all)} sandbox commands recorded: no command_s fit (a task without a sandbox)")
    waits = _lists(tr, "pool_wait_s") if "pool_wait_s" in tr else []
    dur = (tr["end_s"] - tr["start_s"]).to_numpy(dtype=np.float64)
    wait_tot = np.array([w.sum() for w in waits]) if waits else np.zeros(len(tr))
    pool = {"wait_s_total": float(wait_tot.sum()), "episode_s_total": float(dur.sum()),
            "waits_over_1ms": int(sum((w > 1e-3).sum() for w in waits)),
            "sandboxes": int(sum(len(w) for w in waits))}
    if len(tr):
        figures["pool_wait_share"] = _share(wait_tot, dur, rng)
    cap_max = float(cap) if cap else float(t.max())
    vals = subsample(t)
    written: dict[str, dict[str, Any]] = {}
    for k, f in fits.items():
        if k not in WORKLOAD_FIELDS:
            continue
        written[k] = f.dist() if f.fits_the_mean() else f.empirical()
        if not f.fits_the_mean():
            notes.append(f"{k}: the lognormal (median {f.median.value:.3g}, sigma {f.sigma.value:.3g}) averages "
                         f"{f.clipped_mean():.3g} {f.median.unit}, the values {f.mean.value:.3g}: not one lognormal, "
                         f"the workload takes the measured values (empirical, "
                         f"{min(len(f.values), EMPIRICAL_MAX_VALUES)} of {len(f.values)})")
    runs = tuple(str(log.directory) for log in logs)
    workload: dict[str, Any] = {
        "name": name or f"{plan_name}-measured",
        "description": f"measured from {len(tr)} episodes of {len(logs)} real run(s) of plan {plan_name}",
        "source": f"mixfleet calibrate --workload-out, run log(s) {', '.join(Path(r).name for r in runs)}",
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "prompts_per_update": ppu, "samples_per_prompt": spp, "max_context": base.max_context,
        "success_prob": _r(figures["success_prob"].value), "no_tool_call_prob": _r(figures["no_tool_call_prob"].value),
        "turns": {"kind": "empirical", "values": [float(v) for v in vals], "min": 1.0, "max": cap_max,
                  "integer": True},
        **written,
    }
    counts = {"runs": len(logs), "episodes": len(tr), "tool_calls": int(calls.sum()),
              "between_calls": int(sum(len(x) for x in lat)), "sandbox_starts": int(sum(len(s) for s in starts)),
              "commands": int(len(cmd_all))}
    fit = WorkloadFit(workload=workload, fits=fits, figures=figures, counts=counts, pool=pool, runs=runs,
                      notes=tuple(notes))
    fit.spec()
    return fit


__all__ = ["BOOTSTRAP_SAMPLES", "INTERVAL", "Estimate", "LognormalFit", "WorkloadFit", "fit_lognormal",
           "fit_workload"]
