"""The re-planning autoscaler (`replan`): the twin in the loop, re-planning a running fleet from its own log.

A plan is made once, from priors; a group that turns out slower or more mismatched than its prior keeps its replicas
to the end. `replan` closes the loop. It reads the run's records as they are written (the run log's writer hands it
each one: `RunLogWriter.observe`) and, after each update:

1. every `check_every_updates` updates (once `warmup_updates + window_updates` + a prompt-group's life have passed,
   and as long again after a change) it fits the groups on the last `window_updates` updates with the calibration
   code (`costmodel.calibration.fit.calibrate` on a `FrameLog` of the window): speed (`decode_scale` against the prior
   replica model), weight-sync seconds, KL and extreme-ratio share, the trainer's step; each value with its standard
   error;
2. it re-solves when `every_updates` have passed since the last re-solve, or sooner when a fitted value has left the
   interval of the values the fleet was last sized on (the prior at first: |fit - ref| > drift_sigma x stderr and >
   drift_rel x |ref|). The solver (the world hands one in, `attach`: the twin and the runner attach the planner's
   own analytic model, `planner.solver`) returns the replica counts within the plan's pool (each group's
   [min_replicas, max_replicas], only the groups in `groups`), the budget, staleness and time limits, and the
   objective, with its predictions for the current counts and the new ones;
3. it adopts the new counts only when they differ, meet the limits, and the predicted gain 1 - objective(new) /
   objective(now) is at least `min_gain` (a move costs updates' worth of re-prefilled sessions, and the fit reads
   the groups it sees a little slow; docs/twin.md); after a change it holds for `hold_updates` updates, and
   scale-downs wait until the groups it scales up are up (make-before-break). With a staleness bound, it never adopts
   counts the model predicts above it, and when the window's measured staleness is over the bound it only adopts
   counts predicted to lower it.

Each decision (adopted or not) is one `replan` event in the run log: before and after counts, the fitted values with
their stderr, the predicted objective, time per update and staleness now and after, and the gain. The world scales
toward the counts through `target` (a scale-up pays the group's cold start); `stops_busy` lets the twin stop a busy
replica (its requests resume elsewhere) where the fixed autoscalers wait for an idle one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from mixfleet.costmodel.calibration.fit import calibrate
from mixfleet.costmodel.calibration.logs import FrameLog, inflight_limit
from mixfleet.costmodel.calibration.record import Calibration, CalibrationError, GroupCalibration
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.records.runlog import (
    EventRecord,
    GroupRecord,
    Record,
    TrajectoryRecord,
    UpdateRecord,
    records_frame,
)
from mixfleet.policies.autoscaler import Autoscaler, _check_base
from mixfleet.policies.registry import register
from mixfleet.policies.views import GroupView

OBJECTIVES = ("cost_per_update", "cost_per_effective_update")
MIN_TRAJECTORIES = 5                 # a group's trajectories in the window for its own fit
MAX_REL_STDERR = 0.25                # a fitted value with a larger relative stderr is not identified (kept)
THIN_SHARE = 0.5                     # a group with fewer trajectories than this x the mean per group is not fitted
WHERE = "policies.autoscaler (replan)"


@dataclass(frozen=True, kw_only=True)
class Proposal:
    """A solver's answer: replica counts per group and the model's predictions at the current and new counts."""
    counts: dict[str, int]
    objective_now: float             # USD per update (or per effective update) at the current counts
    objective_new: float
    time_per_update_now_s: float
    time_per_update_new_s: float
    staleness_now: float             # mean per-token staleness, versions
    staleness_new: float
    feasible: bool                   # the new counts meet the limits (budget, staleness, time per update)
    anchor: float = 1.0              # the factor on every fitted decode_scale that matched the measured time
    trainer_anchor: float = 1.0      # the factor on the fitted train step that matched the measured one
    note: str = ""

    @property
    def gain(self) -> float:
        """Predicted relative saving of the new counts, 1 - new / now (nan when either is not finite)."""
        a, b = self.objective_now, self.objective_new
        return 1.0 - b / a if math.isfinite(a) and math.isfinite(b) and a > 0 else math.nan


# solver(fit, current counts, groups it may change, measured figures of the window) -> Proposal; the measured
# figures: "time_per_update_s" (mean over the window), "staleness" (token-weighted mean) and "train_step_s" (mean)
Solver = Callable[[Calibration, dict[str, int], tuple[str, ...], dict[str, float]], Proposal]


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One re-planning decision, as its `replan` event's detail holds it."""
    version: int
    time_s: float
    adopted: bool
    reason: str
    trigger: str
    before: dict[str, int]
    after: dict[str, int]
    gain: float
    fitted: dict[str, Any]
    predicted: dict[str, float]
    window: tuple[int, int]

    def detail(self) -> str:
        def clean(x: Any) -> Any:
            if isinstance(x, float):
                return x if math.isfinite(x) else None
            if isinstance(x, dict):
                return {k: clean(v) for k, v in x.items()}
            if isinstance(x, list | tuple):
                return [clean(v) for v in x]
            return x

        return json.dumps(clean({"adopted": self.adopted, "reason": self.reason, "trigger": self.trigger,
                                 "before": self.before, "after": self.after, "gain": self.gain,
                                 "predicted": self.predicted, "fitted": self.fitted, "window": list(self.window)}))

    def record(self) -> EventRecord:
        return EventRecord(time_s=self.time_s, kind="replan", version=self.version, detail=self.detail())


def _check_int(name: str, v: Any, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise SpecError(WHERE, name, v, f"an integer >= {lo}")


@register("autoscaler", "replan")
class Replan(Autoscaler):
    """Every K updates (or on drift) re-fit the groups on a window of the run's own log, re-solve the counts."""

    stops_busy = True   # a scale-down may stop a busy replica (its requests resume elsewhere)

    @dataclass(frozen=True, kw_only=True)
    class Config(Autoscaler.Config):
        idle_timeout_s: float = 0.0          # the re-planner's hysteresis holds changes, not a surplus timer
        every_updates: int = 4               # re-solve at least this often (updates)
        window_updates: int = 4              # the fit's window: the last this many updates
        check_every_updates: int = 4         # fit (and test for drift) this often (updates)
        warmup_updates: int = 2              # updates left out at the start (pipeline fill)
        hold_updates: int = 8                # after a change, no other for this many updates
        min_gain: float = 0.10               # adopt only a predicted relative saving at least this (see the doc)
        drift_sigma: float = 3.0             # a fit this many stderr away from its reference is drift ...
        drift_rel: float = 0.10              # ... when also this far in relative terms
        groups: tuple[str, ...] = ()         # the groups it may change (() = every group)
        objective: str = "cost_per_update"   # or cost_per_effective_update
        max_staleness: float | None = None   # mean per-token staleness bound, versions
        max_time_per_update_s: float | None = None
        max_usd_per_hour: float | None = None  # fleet + trainer

        def __post_init__(self) -> None:
            _check_base(WHERE, self)
            for name, lo in (("every_updates", 1), ("window_updates", 2), ("check_every_updates", 1),
                             ("warmup_updates", 0), ("hold_updates", 0)):
                _check_int(name, getattr(self, name), lo)
            if not (isinstance(self.min_gain, int | float) and 0 <= self.min_gain < 1):
                raise SpecError(WHERE, "min_gain", self.min_gain, "a share in [0, 1)")
            for name in ("drift_sigma", "drift_rel"):
                if not (isinstance(getattr(self, name), int | float) and getattr(self, name) >= 0):
                    raise SpecError(WHERE, name, getattr(self, name), ">= 0")
            if self.objective not in OBJECTIVES:
                raise SpecError(WHERE, "objective", self.objective, OBJECTIVES)
            for name in ("max_staleness", "max_time_per_update_s", "max_usd_per_hour"):
                v = getattr(self, name)
                if v is not None and not (isinstance(v, int | float) and v > 0):
                    raise SpecError(WHERE, name, v, "a positive number (or left out)")
            gs = self.groups
            if isinstance(gs, str) or not isinstance(gs, list | tuple) or not all(isinstance(g, str) for g in gs):
                raise SpecError(WHERE, "groups", gs, "a list of the plan's group names")
            object.__setattr__(self, "groups", tuple(gs))

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.solver: Solver | None = None
        self.header: dict[str, Any] = {}
        self.targets: dict[str, int] = {}          # the counts it scales toward (the plan's at first)
        self.decisions: list[Decision] = []
        self._traj: list[TrajectoryRecord] = []
        self._groups: list[GroupRecord] = []
        self._events: list[EventRecord] = []
        self._updates: list[UpdateRecord] = []
        self._last_check = self._last_solve = self._last_change = -10**9
        self._reference: Calibration | None = None   # what the current counts were sized on (None: the priors)
        self._last_fit: dict[str, GroupCalibration] = {}  # per group, its latest fitted values
        self._up: dict[str, tuple[int, int, int]] = {}  # per group when last seen: replicas up, min, max

    # ---- wiring: the world hands in its log writer and a solver ------------------------------------------
    def attach(self, writer: Any, solver: Solver) -> None:
        """Read the run as `writer` (a `RunLogWriter`) writes it, log decisions through it, re-solve with `solver`.
        The plan's groups and counts come from the writer's header (`plan`)."""
        plan = (writer.header or {}).get("plan") or {}
        names = [g["name"] for g in plan.get("groups", [])]
        for g in self.config.groups:
            if g not in names:
                raise SpecError(WHERE, "groups", g, "a group of the plan: " + ", ".join(names))
        self.header, self.solver = writer.header, solver
        self.targets = {g["name"]: int(g.get("replicas", 1)) for g in plan.get("groups", [])}
        writer.observe(self.observe)

    @property
    def touch(self) -> tuple[str, ...]:
        return self.config.groups or tuple(self.targets)

    def wish(self, group: GroupView, now_s: float) -> int:
        return self.targets.get(group.name, group.configured_replicas)

    def target(self, group: GroupView, now_s: float) -> int:
        """The base's target, make-before-break: a group scales down only once every group it scales up has its
        replicas up (its sessions move to replicas that are serving, not to a queue behind their cold starts)."""
        self._up[group.name] = (group.up_replicas, group.min_replicas, group.max_replicas)
        want = super().target(group, now_s)
        rising = any(up < min(max(self.targets.get(g, up), lo), hi)
                     for g, (up, lo, hi) in self._up.items() if g != group.name)
        return max(want, group.live_replicas) if want < group.live_replicas and rising else want

    # ---- the run as it is written --------------------------------------------------------------------
    def observe(self, record: Record) -> Iterable[Record]:
        """Keep the window's records; after an update, maybe decide (the decision's event comes back)."""
        if isinstance(record, TrajectoryRecord):
            self._traj.append(record)
        elif isinstance(record, GroupRecord):
            self._groups.append(record)
        elif isinstance(record, EventRecord):
            if record.kind == "weight_push":
                self._events.append(record)
        elif isinstance(record, UpdateRecord):
            self._updates.append(record)
            d = self.after_update(record)
            if d is not None:
                return [d.record()]
        return ()

    def after_update(self, update: UpdateRecord) -> Decision | None:
        cfg = self.config
        n = len(self._updates)
        if self.solver is None or n < cfg.warmup_updates + cfg.window_updates + self.span_updates():
            return None
        if n - self._last_check < cfg.check_every_updates:
            return None
        if n - self._last_change < cfg.window_updates + self.span_updates():
            return None   # the window still holds sessions that ran through the last change (moved, re-prefilled)
        self._last_check = n
        frame = self.window()
        try:
            fit = self.fit(frame)
        except CalibrationError as e:
            return self._decide(update, None, adopted=False, reason=f"no fit: {e}", trigger="check")
        drift = self.drift(fit)
        held = n - self._last_change < cfg.hold_updates
        due = n - self._last_solve >= cfg.every_updates or bool(drift)
        if held or not due:
            return None
        self._last_solve = n
        trigger = ("drift: " + ", ".join(drift)) if drift else f"every {cfg.every_updates} updates"
        return self._decide(update, fit, adopted=None, reason="", trigger=trigger)

    def _decide(self, update: UpdateRecord, fit: Calibration | None, *, adopted: bool | None, reason: str,
                trigger: str) -> Decision:
        cfg = self.config
        before = dict(self.targets)
        pred: dict[str, float] = {}
        after = before
        gain = math.nan
        if fit is not None and self.solver is not None:
            p = self.solver(fit, before, self.touch, self.measured())
            after = {k: int(v) for k, v in p.counts.items()}
            gain = p.gain
            pred = {"objective": cfg.objective, "now": p.objective_now, "new": p.objective_new,
                    "time_per_update_now_s": p.time_per_update_now_s,
                    "time_per_update_new_s": p.time_per_update_new_s,
                    "staleness_now": p.staleness_now, "staleness_new": p.staleness_new,
                    "staleness_measured": self.measured_staleness(),
                    "time_per_update_measured_s": self.measured()["time_per_update_s"], "speed_anchor": p.anchor,
                    "trainer_anchor": p.trainer_anchor}
            adopted, reason = self._judge(p, before, after)
            if adopted:
                self.targets.update({g: after[g] for g in self.touch if g in after})
                self._last_change = len(self._updates)
                self._reference = fit
            else:
                after = before
        lo = self._updates[-cfg.window_updates].version if len(self._updates) >= cfg.window_updates else -1
        d = Decision(version=update.version, time_s=update.end_s, adopted=bool(adopted), reason=reason,
                     trigger=trigger, before=before, after=dict(self.targets) if adopted else after, gain=gain,
                     fitted=fitted_summary(fit), predicted=pred, window=(lo, update.version))
        self.decisions.append(d)
        return d

    def _judge(self, p: Proposal, before: dict[str, int], after: dict[str, int]) -> tuple[bool, str]:
        cfg = self.config
        if all(after.get(g, before[g]) == before[g] for g in before):
            return False, "the solver keeps the current counts"
        if not p.feasible:
            return False, f"the new counts miss a limit ({p.note})" if p.note else "the new counts miss a limit"
        if cfg.max_staleness is not None:
            if not p.staleness_new <= cfg.max_staleness:
                return False, f"predicted staleness {p.staleness_new:.3g} is over the bound {cfg.max_staleness:g}"
            measured = self.measured_staleness()
            if measured > cfg.max_staleness and not p.staleness_new < p.staleness_now:
                return False, (f"measured staleness {measured:.3g} is over the bound {cfg.max_staleness:g}: only "
                               "counts predicted to lower it")
        if not p.gain >= cfg.min_gain:
            return False, f"predicted gain {p.gain:.2%} < min_gain {cfg.min_gain:.0%}"
        return True, f"predicted gain {p.gain:.2%}"

    # ---- the window and its fit --------------------------------------------------------------------
    def measured(self) -> dict[str, float]:
        """The window's measured time per update (mean interval between update ends), staleness and train step
        (mean seconds of the trainer's step, weight sync not included)."""
        ends = np.array([u.end_s for u in self._updates[-self.config.window_updates - 1:]], dtype=np.float64)
        tpu = float(np.diff(ends).mean()) if len(ends) > 1 else math.nan
        steps = np.array([u.train_step_s for u in self._updates[-self.config.window_updates:]], dtype=np.float64)
        steps = steps[np.isfinite(steps)]
        return {"time_per_update_s": tpu, "staleness": self.measured_staleness(),
                "train_step_s": float(steps.mean()) if len(steps) else math.nan}

    def measured_staleness(self) -> float:
        """Token-weighted mean staleness over the window's updates."""
        ups = self._updates[-self.config.window_updates:]
        w = np.array([u.tokens for u in ups], dtype=np.float64)
        s = np.array([u.staleness_mean for u in ups], dtype=np.float64)
        ok = np.isfinite(s) & (w > 0)
        return float((s[ok] * w[ok]).sum() / w[ok].sum()) if ok.any() else math.nan

    def span_updates(self) -> int:
        """Updates a prompt-group lives (prompts in flight / prompts per update, + 1): how far back the window's
        trajectories reach, since a trajectory is logged only when its group is trained."""
        bat = (((self.header.get("plan") or {}).get("policies") or {}).get("batcher") or {})
        k, b = inflight_limit(self.header), bat.get("prompts_per_update")
        return math.ceil(k / b) + 1 if isinstance(k, int) and isinstance(b, int) and b > 0 else 1

    def window(self) -> FrameLog:
        """The window as a FrameLog: the last `window_updates` updates with their group rows and weight pushes,
        and the trajectories that ran from the start of the `window_updates + span_updates()`-th last update
        on (a trajectory is logged only once trained, a prompt-group's life later). `known`: from that start to
        now. The sessions still in flight (a long-tailed share on agentic workloads) are not in the frames, so the
        fit undercounts the replicas' concurrency near the end and reads every group somewhat slow: the solver
        takes the fitted speeds relative to each other and anchors their scale on the window's measured time
        per update (`planner.solver.planner_solver`)."""
        cfg = self.config
        ups = self._updates[-cfg.window_updates:]
        first_v = ups[0].version
        back = cfg.window_updates + self.span_updates()
        t_lo = self._updates[-back - 1].end_s if len(self._updates) > back else -math.inf
        self._traj = [t for t in self._traj if t.end_s > t_lo]
        self._groups = [g for g in self._groups if g.version >= first_v]
        self._events = [e for e in self._events if e.version >= first_v]
        tr = records_frame("trajectories", self._traj)
        until = ups[-1].end_s   # sessions still in flight are not in the frames: `solve` anchors the speed
        return FrameLog(header=self.header, trajectories=tr, updates=records_frame("updates", ups),
                        groups=records_frame("groups", self._groups), events=records_frame("events", self._events),
                        directory=f"<window of updates {first_v}..{ups[-1].version}>", known=((t_lo, until),))

    def fit(self, frame: FrameLog) -> Calibration:
        """Calibrate on the window. A thin group (fewer trajectories in it than MIN_TRAJECTORIES, or than
        THIN_SHARE of the mean per group: one replica beside dozens) is left out of the fit and keeps the values
        of its last fit (its prior before one): on the seed's plan a one-replica group's fit came out precise and
        wrong (decode_scale 0.33 +- 0.015 for a group at its prior), since its few sessions spend most of their
        life in tool calls, which the shared turn latency fitted on the busy groups prices."""
        tr = frame.trajectories
        counts = tr.groupby("group").size() if len(tr) else {}
        plan = dict(frame.header.get("plan") or {})
        names = [g["name"] for g in plan.get("groups", [])]
        floor = max(MIN_TRAJECTORIES, THIN_SHARE * len(tr) / max(len(names), 1))
        thin = [n for n in names if int(counts.get(n, 0)) < floor]
        if thin:
            plan["groups"] = [g for g in plan["groups"] if g["name"] not in thin]
            if not plan["groups"]:
                raise CalibrationError([f"groups with at least {MIN_TRAJECTORIES} trajectories in the window"])
            frame = replace(frame, header={**frame.header, "plan": plan},
                            trajectories=tr[~tr["group"].isin(thin)].reset_index(drop=True))
        fit = calibrate([frame], min_trajectories=MIN_TRAJECTORIES)
        groups = tuple(self._identified(g) for g in fit.groups)
        kept = tuple(self._last_fit[g] for g in thin if g in self._last_fit)
        self._last_fit.update({g.name: g for g in groups})
        return replace(fit, groups=groups + kept)

    def _identified(self, g: GroupCalibration) -> GroupCalibration:
        """`g` with each value the window did not identify (not fitted, or its stderr over MAX_REL_STDERR of it: a
        replica or two with few trajectories) replaced by its last identified value, else its prior."""
        last = self._last_fit.get(g.name)
        out = {}
        for p in ("decode_scale", "weight_sync_s", "kl_k3", "extreme_share"):
            f = getattr(g, p)
            ok = f.fitted and math.isfinite(f.stderr) and f.stderr <= MAX_REL_STDERR * abs(f.value) and f.value > 0
            if not ok:
                old = getattr(last, p) if last is not None else None
                out[p] = old if old is not None else replace(f, value=f.prior, stderr=math.nan, fitted=False,
                                                             note="not identified in the window: prior kept")
        if "decode_scale" in out:   # the prefill overhead is fitted as decode_scale x its prior
            pf = g.prefill_overhead_s
            out["prefill_overhead_s"] = replace(pf, value=out["decode_scale"].value * pf.prior)
        return replace(g, **out) if out else g

    def drift(self, fit: Calibration) -> list[str]:
        """Groups whose fitted speed, sync or mismatch left the interval of the values the counts were sized
        on (the previous adopted fit, else the priors)."""
        cfg = self.config
        out = []
        for g in fit.groups:
            ref = self._reference.group(g.name) if self._reference is not None else None
            for p in ("decode_scale", "weight_sync_s", "kl_k3", "extreme_share"):
                f = getattr(g, p)
                if not f.fitted:
                    continue
                r = getattr(ref, p).value if ref is not None else f.prior
                if not math.isfinite(r):
                    continue
                se = f.stderr if math.isfinite(f.stderr) else 0.0
                if abs(f.value - r) > cfg.drift_sigma * se and abs(f.value - r) > cfg.drift_rel * abs(r):
                    out.append(f"{g.name}.{p}")
        return out


def replan_decisions(events: Any) -> list[dict[str, Any]]:
    """The `replan` events of a run log's events frame (`RunLog.events`), one dict per decision in time order:
    `version`, `time_s` and the event's detail (`Decision.detail`: adopted, reason, trigger, before, after, gain,
    predicted, fitted, window). The one reader of the event's format (the Runs page, the benchmarks)."""
    if events is None or not len(events) or "kind" not in events:
        return []
    rp = events[events["kind"] == "replan"].sort_values("time_s", kind="stable")
    return [{"version": int(r.version), "time_s": float(r.time_s), **json.loads(r.detail)} for r in rp.itertuples()]


def fitted_summary(fit: Calibration | None) -> dict[str, Any]:
    """The fit's values as [value, stderr] per group and for the trainer (what a `replan` event records)."""
    if fit is None:
        return {}
    out: dict[str, Any] = {}
    for g in fit.groups:
        out[g.name] = {p: [getattr(g, p).value, getattr(g, p).stderr]
                       for p in ("decode_scale", "weight_sync_s", "kl_k3", "extreme_share")}
    out["trainer"] = {"scale": [fit.trainer_scale.value, fit.trainer_scale.stderr],
                      "overhead_s": [fit.trainer_overhead_s.value, fit.trainer_overhead_s.stderr]}
    return out


__all__ = ["Decision", "Proposal", "Replan", "Solver", "fitted_summary", "replan_decisions"]
