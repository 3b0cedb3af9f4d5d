"""The mix planner: which (accelerator, precision) groups, how many replicas, how many prompts in flight.

1. Candidate group types: every accelerator in the pool x every precision it runs natively (x KV dtypes), that
   fits the model, priced by costmodel's one group record (`planspec.resolve_group`, the twin's: replica model
   prior or calibrated, TP, KV capacity, price, weight sync, mismatch), with its busy throughput
   (`ReplicaModel.operating_point` at `planner_load`): the batch its KV holds of the running set (up to the
   engine's cap) and the step time at that set's context. The running set is the workload's turns weighted by
   their reply tokens (a replica decodes all running requests at one rate, so a request holds KV for a time
   proportional to its reply): long, late turns of long episodes, about 1.3x the mean turn's context on the seed
   workload (`twin.episodes.workload_shape`, measured on the twin's own episode draws, the max_context cut
   included). Prefill (serial, stalls decoding) is added per reply token. Per accelerator,
   `PlannerConfig.precisions` narrows the precisions (or names emulated ones, with `emulated`) and
   `PlannerConfig.prices` overrides the price table; the written plan carries those prices.
2. Screen (analytic, vectorized over thousands of candidates): for a mix n (replicas per type) and K prompts
   in flight, fleet throughput T = sum over types of n_i x min(tps_i, what its sessions ask for): the active
   sessions (K x samples / r, r = E[longest of a group's samples] / E[one]: finished samples wait for their
   siblings) routed by capacity, each alternating decode, prefill and tool calls, decoding at the speed of the
   batch its replica then runs (`session_limited_throughput`, a fixed point); sampler time per update G / T
   for G generated tokens per update; time per update = max(sampler
   time, train step + weight push) (fully async); staleness by Little's law: a prompt-group lives K / B update
   periods, its tokens are on average f of that old when it completes (f = E[sum D_i (max D - D_i / 2)] /
   (E[sum D_i] E[max D]) over a group's episode lengths D, 1/2 for constant ones), and the update that trains
   it publishes (train + push) / time per update later: K / B x f + (train + push) / time per update
   (unbounded when the trainer is the bottleneck); cost per update = (fleet + trainer USD/h) x time per
   update. Cost per
   *effective* update divides by the share of tokens the correction keeps, 1 - sum_i share_i m_i, with
   m_i the group's prior extreme-ratio share (what MIS masks), so a cheap but mismatched group pays for
   the tokens it wastes. Candidates come from integer programs (`scipy.optimize.milp`: cheapest fleet
   reaching each of a sweep of throughput targets under the GPU caps and budget), their +-1 neighbours
   and single-type fleets, each with several K.
3. Verify the best few (default 3) in the twin's steady state (`simulate` from a warm start, then costmodel's
   steady-state analysis: the pipeline fill and the MSER-5 warm-up left out, 95% batch-means intervals), on
   `verify_seeds` seeds each, and re-rank them by it (those meeting the constraints in the twin first, then the
   objective); the chosen plan's figures are the twin's, the analytic ones beside them. Report the Pareto set
   (cost/update, time/update, staleness). The checks are independent jobs (`twin_check`) handed to a map
   (`plan_mix(check_map=...)`): by default as processes on this machine's cores, each check's result kept on disk
   under its inputs' digest and read back when asked again (`twin.checks.default_map`), or one after another in
   this process (`sequential_map`, the reference), or as Ray tasks
   (`mixfleet.runner.orchestration.ray_map.ray_map`, which `mixfleet plan --workers N / --address` passes in),
   with the same results for the same seeds; `PlanResult.checks` says how many workers and nodes ran them and
   the wall time.

Spot capacity (`PlannerConfig.spot`): each named accelerator with a spot price in the price table
(`Catalog.spot`) also offers its groups as spot groups (`-SPOT`, `GroupPlan.spot`), priced at the spot price and
preempted at the catalog's rate (or `spot_preemptions_per_hour`). The screen discounts a spot replica's
throughput by the share of its time a preemption costs (`GroupType.loss_share`: the replacement's cold start and
weight load, plus the work in flight as the plan's `on_loss` treats it: "restart" regenerates its running
trajectories so far, "resume" re-prefills their contexts); `expected_lost_work` gives the plan's preemptions,
lost replica-seconds and USD per update; the twin simulates the preemptions (the one fault process,
`[faults]`), and `PlanResult.on_demand` is the best mix without spot groups beside it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.limits import MAX_GPUS, check_count
from mixfleet.costmodel.plan.planspec import (
    ON_LOSS,
    FaultsPlan,
    ResolvedGroup,
    group_calibration,
    resolve_group,
    resolve_trainer,
)
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.costmodel.specs.formats import formats
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.costmodel.specs.workload import load_workload
from mixfleet.costmodel.steptime.measured import Layout
from mixfleet.costmodel.steptime.roofline import (
    DEFAULT_MAX_BATCH,
    ServingLoad,
    candidate_layouts,
    cheapest,
    kv_capacity_tokens,
)
from mixfleet.policies.plan import GroupPlan, Plan, PoliciesPlan, PolicyRef, TrainerPlan, plan_from_dict
from mixfleet.twin.episodes import WorkloadShape, workload_shape
from mixfleet.twin.planner_defaults import DEFAULTS
from scipy.optimize import Bounds, LinearConstraint, milp

OBJECTIVES = ("cost_per_update", "cost_per_effective_update")
K_FACTORS = (1, 2, 3, 4, 6, 8)     # prompts in flight, in units of prompts per update
MAX_VERIFY_SEEDS = 64
MAX_LOSS_SHARE = 0.9               # a spot replica loses at most this share of its time to preemptions
SPOT_SUFFIX = "-SPOT"
CheckMap = Callable[[Callable[..., dict[str, Any]], list[tuple[Any, ...]]], tuple[list[dict[str, Any]], dict[str, Any]]]


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    """What to plan for. Caps are GPUs per accelerator type; constraints are optional (None = no limit). The
    defaults are `planner_defaults.DEFAULTS`, the one set `mixfleet plan` and the app's Plan page share."""
    model: str = DEFAULTS.model
    workload: str = DEFAULTS.workload
    price_table: str = DEFAULTS.price_table
    accelerators: tuple[str, ...] = ()          # () = every GPU in the catalog
    max_gpus: dict[str, int] = field(default_factory=dict)  # per accelerator; default `default_max_gpus`
    default_max_gpus: int = DEFAULTS.default_max_gpus
    kv_dtypes: tuple[str, ...] = DEFAULTS.kv_dtypes
    trainer_accelerator: str = DEFAULTS.trainer_accelerator
    trainer_gpus: int = DEFAULTS.trainer_gpus
    max_staleness: float | None = DEFAULTS.max_staleness  # mean per-token staleness, versions
    max_time_per_update_s: float | None = DEFAULTS.max_time_per_update_s
    max_usd_per_hour: float | None = DEFAULTS.max_usd_per_hour  # fleet + trainer
    objective: str = DEFAULTS.objective
    verify: int = DEFAULTS.verify  # best candidates the twin verifies in steady state and re-ranks
    verify_updates: int = DEFAULTS.verify_updates  # updates per verification (0: 10 + 2 K / B, `verify_updates`)
    seed: int = DEFAULTS.seed
    prices: dict[str, float] = field(default_factory=dict)  # accelerator -> USD per GPU-hour, over the price table
    precisions: dict[str, tuple[str, ...]] = field(default_factory=dict)  # accelerator -> allowed weight precisions
    emulated: bool = DEFAULTS.emulated  # `precisions` may name formats an accelerator only emulates
    calibration: Any = None                     # a costmodel.calibration.record.Calibration: its fitted values replace
                                                # the priors for the groups and trainer it covers (None = priors)
    layouts: str = DEFAULTS.layouts             # "smallest": smallest TP that fits; "cheapest": every layout (TP
                                                # 1-8, attention DP + EP for MoE), the lowest $/token at the workload
    backend: str = DEFAULTS.backend  # replica step times: roofline | auto | aiconfigurator
    spot: tuple[str, ...] = DEFAULTS.spot       # accelerators whose spot capacity may be used (("all",): every one
                                                # with a spot price in the price table); () = on-demand only
    spot_preemptions_per_hour: float | None = None  # spot replicas' preemption rate (None: the catalog's)
    on_loss: str = DEFAULTS.on_loss  # work in flight on a lost replica: "resume" | "restart" (the plan's)
    verify_seeds: int = DEFAULTS.verify_seeds  # seeds per verified candidate (cfg.seed, cfg.seed + 1, ...)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise SpecError("plan", "objective", self.objective, OBJECTIVES)
        if self.layouts not in ("smallest", "cheapest"):
            raise SpecError("plan", "layouts", self.layouts, ("smallest", "cheapest"))
        if self.backend not in ("roofline", "auto", "aiconfigurator"):
            raise SpecError("plan", "backend", self.backend, ("roofline", "auto", "aiconfigurator"))
        for f in ("max_staleness", "max_time_per_update_s", "max_usd_per_hour"):
            v = getattr(self, f)
            if v is not None and not v > 0:
                raise SpecError("plan", f, v, "a positive number (or none)")
        if self.verify < 0 or self.verify_updates < 0:
            raise SpecError("plan", "verify", self.verify, "verify >= 0 and verify_updates >= 0 (0: automatic)")
        check_count("plan", "verify_seeds", self.verify_seeds, 1, MAX_VERIFY_SEEDS)
        if self.on_loss not in ON_LOSS:
            raise SpecError("plan", "on_loss", self.on_loss, ON_LOSS)
        v = self.spot_preemptions_per_hour
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 3600):
            raise SpecError("plan", "spot_preemptions_per_hour", v, "a number in [0, 3600] per replica-hour (or none)")
        self._check_pool()
        self._check_spot()
        if self.prices or self.precisions:
            self._check_overrides()

    def _check_pool(self) -> None:
        """Accelerator names in any case ('b200' is 'B200') or refused with the known ones; GPU caps and the
        trainer's GPUs within 1..MAX_GPUS; KV dtypes from the format registry (data/precisions.toml)."""
        cat = load_catalog(self.price_table)

        def canon(f: str, name: Any) -> str:
            try:
                return cat.accelerator(name).name
            except SpecError:
                raise SpecError("plan", f, name, "a known accelerator: " + ", ".join(cat.accelerators)) from None

        hint = " (to leave an accelerator out, name the others with --accelerators)"
        caps = {}
        for a, n in dict(self.max_gpus).items():
            caps[canon("max_gpus", a)] = check_count("plan", f"max_gpus.{a}", n, 1, MAX_GPUS, hint)
        check_count("plan", "default_max_gpus", self.default_max_gpus, 1, MAX_GPUS, hint)
        check_count("plan", "trainer_gpus", self.trainer_gpus, 1, MAX_GPUS)
        object.__setattr__(self, "max_gpus", caps)
        object.__setattr__(self, "accelerators", tuple(canon("accelerators", a) for a in self.accelerators))
        object.__setattr__(self, "trainer_accelerator", canon("trainer_accelerator", self.trainer_accelerator))
        if not self.kv_dtypes:
            raise SpecError("plan", "kv_dtypes", list(self.kv_dtypes), "at least one of " +
                            ", ".join(formats().kv_dtypes))
        for kv in self.kv_dtypes:
            formats().check_kv_dtype("plan", kv, "kv_dtypes")

    def _check_spot(self) -> None:
        """`spot`: accelerators of the catalog with a spot price in this price table (names as the catalog spells
        them; "all" = every one that has one)."""
        if isinstance(self.spot, str):
            object.__setattr__(self, "spot", tuple(a.strip() for a in self.spot.split(",") if a.strip()))
        if not self.spot:
            return
        cat = load_catalog(self.price_table)
        if tuple(a.lower() for a in self.spot) == ("all",):
            names = tuple(cat.spot_accelerators())
            if not names:
                raise SpecError("plan", "spot", "all", f"a price table with spot prices (price table "
                                f"'{self.price_table}' has none; tables: {', '.join(cat.price_tables())})")
        else:
            have = cat.spot_accelerators()
            names = []
            for a in self.spot:
                try:
                    names.append(cat.spot(a).name)
                except SpecError:
                    raise SpecError("plan", "spot", a, f"an accelerator with a spot price in price table "
                                    f"'{self.price_table}': " + (", ".join(have) or "none") + " (or all)") from None
            names = tuple(dict.fromkeys(names))
        object.__setattr__(self, "spot", names)

    def _check_overrides(self) -> None:
        """Per-accelerator prices and precisions: known accelerators (keys become the catalog's names), prices
        > 0, precisions a non-empty subset of the natively supported ones (or emulable ones with `emulated`)."""
        cat = load_catalog(self.price_table)
        known = list(cat.accelerators)

        def canon(f: str, name: Any) -> str:
            try:
                return cat.accelerator(name).name
            except SpecError:
                raise SpecError("plan", f, name, "a known accelerator: " + ", ".join(known)) from None

        prices = {}
        for a, usd in dict(self.prices).items():
            a = canon("prices", a)
            if isinstance(usd, bool) or not isinstance(usd, int | float) or not 0 < usd < 1e9:
                raise SpecError("plan", f"prices.{a}", usd, "USD per GPU-hour, a number > 0")
            prices[a] = float(usd)
        precs: dict[str, tuple[str, ...]] = {}
        for a, ps in dict(self.precisions).items():
            a = canon("precisions", a)
            ok = ("native", "emulated") if self.emulated else ("native",)
            allowed = [p for p in cat.precisions if cat.support(a, p) in ok]
            hint = "" if self.emulated else " (emulated formats need emulated=True, --emulated)"
            ps = ps.split(",") if isinstance(ps, str) else ps
            if not isinstance(ps, list | tuple) or not all(isinstance(p, str) for p in ps):
                raise SpecError("plan", f"precisions.{a}", ps, "a list of precision names: " + ", ".join(allowed))
            ps = tuple(dict.fromkeys(p.strip().lower() for p in ps if p.strip()))
            if not ps:
                raise SpecError("plan", f"precisions.{a}", list(ps), "at least one of " + ", ".join(allowed))
            for p in ps:
                if p not in allowed:
                    raise SpecError("plan", f"precisions.{a}", p, ", ".join(allowed) + hint)
            precs[a] = ps
        object.__setattr__(self, "prices", prices)
        object.__setattr__(self, "precisions", precs)


def _catalog(cfg: PlannerConfig) -> Any:
    """The catalog at the config's price table, with its per-accelerator price overrides."""
    return load_catalog(cfg.price_table).with_prices(cfg.prices)


@dataclass(frozen=True, kw_only=True)
class GroupType:
    name: str                        # e.g. "H100-FP8"
    accelerator: str
    precision: str
    kv_dtype: str
    tp: int
    tokens_per_s: float              # per replica, prefill included
    per_seq_tokens_per_s: float      # one session's decode speed at that batch
    seq_speed_by_batch: tuple[float, ...] = ()   # one session's decode speed (tokens/s) at batch 1, 2, ... b
    prefill_turn_s: float = 0.0      # one turn's prefill (the workload's new tokens per turn), stalls decoding
    usd_per_hour: float
    sync_s: float
    masked_share: float              # prior extreme-ratio share (what the correction masks)
    kl_k3: float
    emulated: bool = False           # the precision is emulated on this accelerator
    dp_attention: int = 1            # layout: attention DP groups over the tp GPUs
    ep: int = 1                      # layout: expert-parallel size
    backend: str = "roofline"        # which backend priced the replica
    group: GroupPlan | None = None   # the candidate group as planned (candidate_plan writes it back)
    spot: bool = False               # spot capacity (priced at the spot price, preempted)
    preemptions_per_hour: float = 0.0   # per replica-hour (spot groups)
    replace_s: float = 0.0           # a replacement replica's cold start + weight load, s
    inflight_loss_s: float = 0.0     # replica-seconds of work in flight one preemption loses (as on_loss treats it)
    loss_share: float = 0.0          # share of a replica's time lost to preemptions: rate x (replace + in flight)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    replicas: dict[str, int]
    inflight_prompts: int
    throughput_tokens_per_s: float
    time_per_update_s: float
    staleness: float
    usd_per_hour: float
    cost_per_update_usd: float
    cost_per_effective_update_usd: float
    kept_share: float                # 1 - masked share of the mix's tokens
    trainer_bound: bool
    verified: dict[str, Any] = field(default_factory=dict)  # the twin's steady state (`verify_candidate`)
    lost_work: dict[str, Any] = field(default_factory=dict)  # expected preemption losses (`expected_lost_work`)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


@dataclass(frozen=True, kw_only=True)
class Binding:
    """One constraint that keeps a feasible plan from a better objective: relaxed alone, the screen's best
    objective would be `relaxed_objective` (vs `objective`), at `relaxed_value` of the limited metric. A GPU cap
    the chosen mix uses up is reported with `relaxed_objective` None: the screen cannot say what more GPUs buy
    without building the candidates again."""
    flag: str                          # the CLI flag (e.g. '--max-staleness'); '--max-gpus' for a cap
    what: str                          # the limited metric in words, or the accelerator for a cap
    limit: float
    unit: str
    objective: float                   # the chosen screen objective (cost per (effective) update)
    relaxed_objective: float | None
    relaxed_value: float | None
    per: str = "update"                # the objective's unit: 'update' or 'effective update'

    @property
    def gain(self) -> float | None:
        """The objective's relative saving if this constraint alone were relaxed (0.12 = 12% cheaper)."""
        if self.relaxed_objective is None or not self.objective > 0:
            return None
        return 1.0 - self.relaxed_objective / self.objective

    def text(self, names: Mapping[str, str] | None = None) -> str:
        """One sentence; `names` maps a CLI flag to the name a page gives the same setting (the app's labels)."""
        flag = (names or {}).get(self.flag)
        if self.relaxed_objective is None:
            head = f"{flag} for {self.what}" if flag else f"{self.flag} {self.what}"
            return (f"{head}={self.limit:g}: the chosen mix uses all {self.limit:g} GPUs allowed; "
                    "more may buy a cheaper mix")
        value = (f"{self.what} {self.relaxed_value:,.3g} {self.unit}" if math.isfinite(self.relaxed_value or 0.0)
                 else f"{self.what} unbounded (a trainer-bound mix)")
        return (f"{flag or self.flag} {self.limit:g} binds: without it the cheapest mix screened costs "
                f"${self.relaxed_objective:,.2f} per {self.per} ({self.gain:.0%} less than ${self.objective:,.2f}) at "
                + value)


@dataclass(frozen=True, kw_only=True)
class PlanResult:
    best: Candidate | None
    plan: Plan | None
    pareto: list[Candidate]
    screened: int
    feasible: int
    types: list[GroupType]
    note: str = ""
    verified: list[Candidate] = field(default_factory=list)  # the twin-verified candidates, in the twin's order
    on_demand: Candidate | None = None   # with cfg.spot: the best mix without spot groups (verified alike)
    checks: dict[str, Any] = field(default_factory=dict)  # the twin checks: mode, tasks, workers, nodes, wall_s
    binds: list[Binding] = field(default_factory=list)  # what keeps the chosen mix from a cheaper one (`what_binds`)


def calibrated_group(cal: Any, accelerator: str, precision: str, kv_dtype: str, name: str = "") -> Any:
    """The calibration's group for a candidate (accelerator, precision, KV dtype) with no kernel of its own,
    by costmodel's one matching rule (`planspec.group_calibration`); None without a calibration or a match."""
    return group_calibration(cal, SimpleNamespace(name=name, accelerator=accelerator, precision=precision,
                                                  kv_dtype=kv_dtype, kernel=""))


def type_name(accelerator: str, precision: str, kv_dtype: str, layout: Layout | None = None, spot: bool = False
              ) -> str:
    """A candidate group's name: 'H100-FP8', 'B200-NVFP4-KVBF16', 'H200-FP8-DEP8' (attention DP / EP layouts),
    'H100-FP8-SPOT' (spot capacity)."""
    suffix = precision.upper() + ("" if kv_dtype == "fp8_e4m3" or precision == "bf16" and kv_dtype == "bf16"
                                  else f"-KV{kv_dtype.upper()}")
    lay = "" if layout is None or (layout.dp_attention == 1 and layout.ep == 1) else f"-{layout.label}"
    return f"{accelerator}-{suffix}{lay}" + (SPOT_SUFFIX if spot else "")


def pool_groups(cfg: PlannerConfig) -> list[GroupPlan]:
    """The pool's candidate groups: every accelerator x each precision it runs natively (or its allowed list in
    `cfg.precisions`, emulated ones flagged) x KV dtype, one replica, the smallest TP that fits (tp 0); on the
    accelerators of `cfg.spot` each also as a spot group."""
    cat = _catalog(cfg)
    out = []
    for a in cfg.accelerators or tuple(cat.gpus()):
        allowed = cfg.precisions.get(cat.accelerator(a).name)
        for spot in (False, True) if cat.accelerator(a).name in cfg.spot else (False,):
            for p in cat.precisions:
                sup = cat.support(a, p)
                if (p in allowed) if allowed is not None else sup == "native":
                    out += [GroupPlan(name=type_name(a, p, kv, spot=spot), accelerator=a, precision=p, kv_dtype=kv,
                                      emulated=sup != "native", spot=spot) for kv in cfg.kv_dtypes]
    return out


def _with_layout(g: GroupPlan, lay: Layout) -> GroupPlan:
    """Candidate `g` on layout `lay` (its GPUs recorded as the plan's tp, dp_attention, ep)."""
    return replace(g, name=type_name(g.accelerator, g.precision, g.kv_dtype, lay, g.spot), tp=lay.gpus,
                   dp_attention=lay.dp_attention, ep=lay.ep)


def group_types(cfg: PlannerConfig, only: list[GroupPlan] | None = None) -> list[GroupType]:
    """The pool's candidate groups (`pool_groups`) that fit the model, or exactly the groups `only` (e.g. a
    plan's), each priced by costmodel's one record (`planspec.resolve_group`: replica model, prior or
    calibrated, weight sync, mismatch, running cap) and turned into the screen's numbers (`type_from`). With
    `cfg.layouts == "cheapest"` a group with tp 0 tries every layout that fits (TP 1-8, and for MoE attention DP
    + expert parallel) and keeps the one with the lowest USD per generated token at the planner's load
    (`roofline.cheapest` at `planner_load`: the batch the workload reaches, prefill charged per DP rank), the
    choice `replica_model(layout="cheapest", load=...)` makes."""
    cat = _catalog(cfg)
    model = load_model_spec(cfg.model)
    wl = load_workload(cfg.workload)
    trainer_acc = cat.accelerator(cfg.trainer_accelerator)
    shape = workload_shape(wl, wl.samples_per_prompt)
    load = planner_load(shape)
    explicit = only is not None
    budget = min(wl.max_context, model.max_context)
    out = []
    for g in (only if only is not None else pool_groups(cfg)):
        variants = [g]
        if g.layout is None and not g.tp and cfg.layouts == "cheapest":
            acc = cat.accelerator(g.accelerator)
            variants = [_with_layout(g, c) for c in candidate_layouts(model, acc.max_tp)
                        if kv_capacity_tokens(model, acc, cat.precision(g.precision), cat.kv_dtype(g.kv_dtype),
                                              c.tp, c.dp_attention) >= budget]
        recs = []
        for v in variants:
            try:
                recs.append(resolve_group(v, model=model, workload=wl, catalog=cat, backend=cfg.backend,
                                          trainer_accelerator=trainer_acc, calibration=cfg.calibration))
            except SpecError:
                if explicit and (v.emulated or v.tp):
                    raise
        if recs:   # the layout choice of replica_model(layout="cheapest"), at the planner's load
            out.append(type_from(recs[cheapest([r.replica for r in recs], load)], shape,
                                 spot_preemptions_per_hour=cfg.spot_preemptions_per_hour, on_loss=cfg.on_loss))
    return out


def planner_load(shape: WorkloadShape) -> ServingLoad:
    """What the workload asks of a busy replica in the planner (and the twin): the running set's context and KV
    per request (reply-weighted, `twin.episodes.workload_shape`), one turn's new tokens per turn's reply, and
    the twin's engine cap of DEFAULT_MAX_BATCH running requests per attention-DP rank."""
    reply_per_turn = shape.generated_per_episode / max(shape.turns_per_episode, 1.0)
    return ServingLoad(context=shape.decode_context, kv_per_request=shape.kv_per_request,
                       prefill_tokens=shape.new_tokens_per_turn, reply_tokens=reply_per_turn,
                       max_running=DEFAULT_MAX_BATCH)


def type_from(r: ResolvedGroup, shape: WorkloadShape, *, spot_preemptions_per_hour: float | None = None,
              on_loss: str = "resume") -> GroupType:
    """The screen's numbers for one resolved group: its operating point at the planner's load (`planner_load`:
    busy batch and throughput with one turn's prefill charged per request, per DP rank), one session's decode
    speed by batch, one turn's prefill; price, weight sync and mismatch as `r` has them. A spot group also gets its
    preemption rate (`spot_preemptions_per_hour`, or the catalog's) and the share of its time preemptions cost
    (`loss_share`): per preemption the replacement's cold start and weight load (`replace_s`), plus the work in
    flight (`inflight_loss_s`): on_loss "restart" regenerates each of the batch's running trajectories so far
    (on average half an episode's reply tokens, at one replica's busy throughput), "resume" re-prefills each one's
    context (the running set's decode context, at one turn's prefill rate)."""
    rm = r.replica
    op = rm.operating_point(planner_load(shape))
    b = op.batch
    batches = np.arange(1, max(1, math.ceil(b)) + 1, dtype=np.float64)
    speeds = np.asarray(rm.tokens_per_s(batches, shape.decode_context), dtype=np.float64) / batches
    g = r.group
    rate_h = (r.spot_preemptions_per_hour if spot_preemptions_per_hour is None else spot_preemptions_per_hour
              ) if g.spot else 0.0
    if on_loss == "restart":
        inflight_s = b * (shape.generated_per_episode / 2.0) / max(op.tokens_per_s, 1e-12)
    else:
        inflight_s = b * op.prefill_s * shape.decode_context / max(shape.new_tokens_per_turn, 1.0)
    loss = min(rate_h / 3600.0 * (rm.cold_start_s + inflight_s), MAX_LOSS_SHARE)
    return GroupType(name=g.name, accelerator=g.accelerator, precision=g.precision, kv_dtype=g.kv_dtype,
                     tp=r.gpus, tokens_per_s=op.tokens_per_s, per_seq_tokens_per_s=op.decode_tokens_per_s / b,
                     seq_speed_by_batch=tuple(speeds.tolist()), prefill_turn_s=op.prefill_s,
                     usd_per_hour=rm.price_usd_per_hour, sync_s=r.weight_sync_s, masked_share=r.extreme_share,
                     kl_k3=r.kl_k3, emulated=g.emulated, dp_attention=rm.dp_attention, ep=rm.ep, backend=rm.backend,
                     group=g, spot=g.spot, preemptions_per_hour=rate_h, replace_s=rm.cold_start_s,
                     inflight_loss_s=inflight_s if rate_h > 0 else 0.0, loss_share=loss)


@contextlib.contextmanager
def _quiet_native_stdout() -> Iterator[None]:
    """HiGHS (scipy's milp) prints debugging lines ("HighsMipSolverData::...") from C++ straight to file
    descriptor 1 even with disp off; send fd 1 to /dev/null meanwhile (Python's own output is flushed first)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # no real stdout (captured): nothing to keep clean
        yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def _milp_candidates(types: list[GroupType], cfg: PlannerConfig, trainer_usd_h: float, effective: bool) -> np.ndarray:
    """Cheapest fleets reaching a sweep of throughput targets (integer replicas, GPU caps, budget)."""
    price = np.array([t.usd_per_hour for t in types])
    tps = np.array([t.tokens_per_s * (1 - t.loss_share) * ((1 - t.masked_share) if effective else 1.0)
                    for t in types])
    accs = sorted({t.accelerator for t in types})
    cap_rows = np.array([[t.tp if t.accelerator == a else 0 for t in types] for a in accs], dtype=float)
    caps = np.array([cfg.max_gpus.get(a, cfg.default_max_gpus) for a in accs], dtype=float)
    ub = np.array([math.floor(cfg.max_gpus.get(t.accelerator, cfg.default_max_gpus) / t.tp) for t in types])
    cons = [LinearConstraint(cap_rows, -np.inf, caps)]
    if cfg.max_usd_per_hour is not None:
        cons.append(LinearConstraint(price[None, :], -np.inf, cfg.max_usd_per_hour - trainer_usd_h))
    t_max = float(tps @ ub)
    out = []
    for target in np.geomspace(max(tps.min(), 1.0), t_max, 32):
        with _quiet_native_stdout():
            res = milp(c=price, integrality=np.ones(len(types)), bounds=Bounds(0, ub),
                       constraints=[*cons, LinearConstraint(tps[None, :], target, np.inf)],
                       options={"time_limit": 2.0})
        if res.x is not None:
            out.append(np.round(res.x).astype(int))
    return np.unique(np.array(out, dtype=int).reshape(-1, len(types)), axis=0)


def screen(types: list[GroupType], cfg: PlannerConfig) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """All candidates (mixes x K) and their analytic metrics, vectorized."""
    cat = _catalog(cfg)
    wl = load_workload(cfg.workload)
    trainer_usd_h = cfg.trainer_gpus * cat.accelerator(cfg.trainer_accelerator).price_usd_per_gpu_hour
    mixes = [_milp_candidates(types, cfg, trainer_usd_h, eff) for eff in (False, True)]
    base = np.unique(np.vstack(mixes), axis=0) if any(len(m) for m in mixes) else np.zeros((0, len(types)), int)
    eye = np.eye(len(types), dtype=int)
    neigh = np.vstack([base, *(base + d for d in eye), *(base - d for d in eye)]) if len(base) else base
    ub = np.array([math.floor(cfg.max_gpus.get(t.accelerator, cfg.default_max_gpus) / t.tp) for t in types])
    singles = np.vstack([eye * n for n in (1, 2, 4, 8, 16, 32, 64)])
    mix = np.unique(np.vstack([neigh, singles]), axis=0)
    mix = mix[(mix >= 0).all(1) & (mix <= ub).all(1) & (mix.sum(1) > 0)]
    accs = sorted({t.accelerator for t in types})
    gpus_by_acc = np.stack([(mix * np.array([t.tp if t.accelerator == a else 0 for t in types])).sum(1) for a in accs])
    caps = np.array([cfg.max_gpus.get(a, cfg.default_max_gpus) for a in accs])[:, None]
    mix = mix[(gpus_by_acc <= caps).all(0)]
    kf = np.array(K_FACTORS)
    n = np.repeat(mix, len(kf), axis=0)
    k = np.tile(kf * wl.prompts_per_update, len(mix))
    return n, k, metrics(types, n, k, cfg)


def metrics(types: list[GroupType], n: np.ndarray, k: np.ndarray, cfg: PlannerConfig,
            update_shape: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """The analytic model for mixes `n` (rows: replicas per type) with `k` prompts in flight (vectorized).
    update_shape: (prompts per update, samples per prompt) when not the workload's."""
    cat = _catalog(cfg)
    model, wl = load_model_spec(cfg.model), load_workload(cfg.workload)
    trainer = resolve_trainer(cfg.trainer_accelerator, cfg.trainer_gpus, model=model, catalog=cat,
                              calibration=cfg.calibration)
    trainer_usd_h = trainer.usd_per_hour
    ppu, spp = update_shape or (wl.prompts_per_update, wl.samples_per_prompt)
    shape = workload_shape(wl, spp)
    gen_tokens = ppu * spp * shape.generated_per_episode
    train_s = float(trainer.step_s(gen_tokens))
    n, k = np.atleast_2d(n), np.atleast_1d(k)
    tps = np.array([t.tokens_per_s for t in types])
    price = np.array([t.usd_per_hour for t in types])
    masked = np.array([t.masked_share for t in types])
    sync = np.array([t.sync_s for t in types])
    cap_tps = n @ tps
    reply, tool = shape.generated_per_episode / max(shape.turns_per_episode, 1.0), wl.tool_latency_s.mean
    thr = session_limited_throughput(types, n, k * spp / shape.group_span, reply, tool)  # siblings wait
    t_sampler = gen_tokens / thr
    t_trainer = train_s + np.max(np.where(n > 0, sync[None, :], 0.0), axis=1)
    trainer_bound = t_trainer > t_sampler
    t_update = np.maximum(t_sampler, t_trainer)
    # Little's law: a prompt-group lives K / B update periods; its tokens are on average f of that old when it
    # completes; it is trained in the update that forms next, which publishes its version train + sync later
    # (a token's staleness counts the versions published between its sampling and its update's start)
    staleness = np.where(trainer_bound, np.inf, k / ppu * shape.stale_fraction + t_trainer / t_update)
    usd_h = n @ price + trainer_usd_h
    cost = usd_h * t_update / 3600.0
    kept = 1.0 - (n * tps) @ masked / np.maximum(cap_tps, 1e-12)
    return {"throughput": thr, "time_per_update_s": t_update, "staleness": staleness, "usd_per_hour": usd_h,
            "cost_per_update": cost, "cost_per_effective_update": cost / kept, "kept_share": kept,
            "trainer_bound": trainer_bound}


SESSION_FIXED_POINT_ITERATIONS = 40


def session_limited_throughput(types: list[GroupType], n: np.ndarray, active: np.ndarray, reply: float,
                               tool_s: float) -> np.ndarray:
    """Fleet tokens/s for mixes `n` (rows) with `active` sessions each (not waiting for siblings), routed in
    proportion to capacity and sticky: per type, S sessions per replica each cycle through a turn (decode
    `reply` tokens, its prefill, a tool call of `tool_s`). A replica decodes its x running sessions at
    `seq_speed_by_batch[x]` each, and every prefill on it stalls them all, so x and the cycle time c solve
    x = S (c - tool) / c,  c = reply / (speed(x) (1 - S prefill / c)) + prefill + tool
    (a fixed point, damped); a replica gives min(S reply / c, its busy tokens/s). Under light load the
    batch is small and each session decodes faster than at the busy batch (the speed the screen used to
    assume for every session, which made it 2x pessimistic at K = B on small batches). A spot type's
    contribution is discounted by the share of its time preemptions cost (`GroupType.loss_share`)."""
    n = np.atleast_2d(np.asarray(n, dtype=np.float64))
    tps = np.array([t.tokens_per_s for t in types])
    cap = np.maximum(n @ tps, 1e-12)
    share = n * tps / cap[:, None]
    thr = np.zeros(len(n))
    for j, t in enumerate(types):
        used = n[:, j] > 0
        if not used.any():
            continue
        speeds = np.asarray(t.seq_speed_by_batch or (t.per_seq_tokens_per_s,), dtype=np.float64)
        top = float(len(speeds))
        batches = np.arange(1, len(speeds) + 1, dtype=np.float64)
        s = np.asarray(active, dtype=np.float64)[used] * share[used, j] / n[used, j]   # sessions per replica
        p = t.prefill_turn_s
        x = np.clip(s, 1.0, top)
        c = reply / np.interp(x, batches, speeds) + p + tool_s
        for _ in range(SESSION_FIXED_POINT_ITERATIONS):
            util = np.clip(1.0 - s * p / c, 0.05, 1.0)
            c_new = reply / (np.interp(x, batches, speeds) * util) + p + tool_s
            c = 0.5 * c + 0.5 * c_new
            x = 0.5 * x + 0.5 * np.clip(s * (c - tool_s) / c, 1.0, top)
        thr[used] += n[used, j] * np.minimum(s * reply / c, t.tokens_per_s) * (1.0 - t.loss_share)
    return thr


def evaluate_plan(plan: Plan, cfg: PlannerConfig | None = None) -> Candidate:
    """The analytic model's numbers for an existing plan (e.g. a seed fleet), for comparison with the DES."""
    wl = load_workload(plan.workload)
    cfg = cfg or PlannerConfig(model=plan.model, workload=plan.workload, price_table=plan.price_table or "modal",
                               prices=dict(plan.prices), backend=plan.cost_backend,
                               trainer_accelerator=plan.trainer.accelerator, trainer_gpus=plan.trainer.gpus)
    types = group_types(cfg, only=list(plan.groups))
    n = np.array([g.replicas for g in plan.groups])
    b = plan.build_policies(wl)["batcher"].config
    shape = (b.prompts_per_update, b.samples_per_prompt)
    return _candidate(types, n, b.inflight_prompts,
                      metrics(types, n[None, :], np.array([b.inflight_prompts]), cfg, shape), 0)


def feasible(m: dict[str, np.ndarray], cfg: PlannerConfig) -> np.ndarray:
    """Which rows of `metrics` output meet the config's staleness, time and budget limits (the planner's and
    the re-planner's one rule)."""
    ok = np.ones(len(m["cost_per_update"]), dtype=bool)
    if cfg.max_staleness is not None:
        ok &= m["staleness"] <= cfg.max_staleness
    if cfg.max_time_per_update_s is not None:
        ok &= m["time_per_update_s"] <= cfg.max_time_per_update_s
    if cfg.max_usd_per_hour is not None:
        ok &= m["usd_per_hour"] <= cfg.max_usd_per_hour + 1e-9
    return ok


_LIMITS = (("max_staleness", "staleness", "--max-staleness", "mean staleness", "versions"),
           ("max_time_per_update_s", "time_per_update_s", "--max-time-per-update", "time per update", "s"),
           ("max_usd_per_hour", "usd_per_hour", "--budget", "USD per hour", "USD/h"))


def binding_constraints(m: dict[str, np.ndarray], cfg: PlannerConfig) -> str:
    """Why no candidate is feasible: each limit with the best value any candidate reaches (it binds when that
    is over the limit) and, for a limit met alone, the best within the other limits; the GPU caps the
    candidates were built under."""
    def fmt(v: float, unit: str) -> str:
        return f"{v:,.3g} {unit}" if math.isfinite(v) else "none"

    parts = []
    for field_name, metric, flag, what, unit in _LIMITS:
        limit = getattr(cfg, field_name)
        if limit is None:
            continue
        best = float(m[metric].min())
        if best > limit + 1e-9:
            parts.append(f"{flag} {limit:g} binds: the best {what} of any candidate is {fmt(best, unit)}")
            continue
        within = m[metric][feasible(m, replace(cfg, **{field_name: None}))]
        parts.append(f"{flag} {limit:g} holds alone (best {fmt(best, unit)}) but not with the others: the best "
                     f"{what} within them is {fmt(float(within.min()) if len(within) else math.inf, unit)}")
    caps = ", ".join(f"{a}={c}" for a, c in cfg.max_gpus.items())
    return (f"no candidate meets the constraints ({len(m['cost_per_update']):,} screened): " + "; ".join(parts)
            + f". GPU caps: {caps + ', ' if caps else ''}{cfg.default_max_gpus} per other accelerator "
            "(--max-gpus, --default-max-gpus); relax a limit that binds.")


def what_binds(m: dict[str, np.ndarray], cfg: PlannerConfig, chosen: int, gpus: dict[str, int] | None = None,
               *, min_gain: float = 1e-3) -> list[Binding]:
    """The constraints that bind on a feasible plan, in order of what relaxing each alone would save: a limit
    binds when the screen's best objective without it (the other limits kept) is lower than the chosen one's by
    more than `min_gain`; a GPU cap binds (may bind) when the chosen mix uses all of it (`gpus`: per accelerator).
    `chosen`: the screen row of the best feasible candidate. None binding: the mix is the cheapest screened."""
    best = float(m[cfg.objective][chosen])
    per = "effective update" if cfg.objective == "cost_per_effective_update" else "update"
    out: list[Binding] = []
    for field_name, metric, flag, what, unit in _LIMITS:
        limit = getattr(cfg, field_name)
        if limit is None:
            continue
        idx = np.flatnonzero(feasible(m, replace(cfg, **{field_name: None})))
        if not len(idx):
            continue
        i = int(idx[np.argmin(m[cfg.objective][idx])])
        relaxed = float(m[cfg.objective][i])
        if relaxed < best * (1.0 - min_gain):
            out.append(Binding(flag=flag, what=what, limit=float(limit), unit=unit, objective=best,
                               relaxed_objective=relaxed, relaxed_value=float(m[metric][i]), per=per))
    out.sort(key=lambda b: -(b.gain or 0.0))
    for acc, used in sorted((gpus or {}).items()):
        cap = cfg.max_gpus.get(acc, cfg.default_max_gpus)
        if used >= cap:
            out.append(Binding(flag="--max-gpus", what=acc, limit=float(cap), unit="GPUs", objective=best,
                               relaxed_objective=None, relaxed_value=None, per=per))
    return out


def binds_text(binds: list[Binding], names: Mapping[str, str] | None = None) -> str:
    """What binds, in one sentence; 'no limit binds' when the chosen mix is the cheapest screened. `names`: the
    settings' names where they are not CLI flags (the app's field labels, by flag)."""
    if not binds:
        return "no limit binds: the chosen mix is the cheapest screened"
    return "; ".join(b.text(names) for b in binds)


def pareto_mask(points: np.ndarray) -> np.ndarray:
    """Rows not dominated by another (all objectives minimized; inf allowed)."""
    keep = np.ones(len(points), dtype=bool)
    for i in range(len(points)):
        dominated = (points <= points[i]).all(1) & (points < points[i]).any(1)
        keep[i] = not dominated.any()
    return keep


def _candidate(types: list[GroupType], n: np.ndarray, k: int, m: dict[str, np.ndarray], i: int) -> Candidate:
    return Candidate(replicas={t.name: int(c) for t, c in zip(types, n, strict=True) if c > 0},
                     inflight_prompts=int(k), throughput_tokens_per_s=float(m["throughput"][i]),
                     time_per_update_s=float(m["time_per_update_s"][i]), staleness=float(m["staleness"][i]),
                     usd_per_hour=float(m["usd_per_hour"][i]), cost_per_update_usd=float(m["cost_per_update"][i]),
                     cost_per_effective_update_usd=float(m["cost_per_effective_update"][i]),
                     kept_share=float(m["kept_share"][i]), trainer_bound=bool(m["trainer_bound"][i]))


def candidate_plan(c: Candidate, types: list[GroupType], cfg: PlannerConfig, name: str = "planned") -> Plan:
    """The Plan for a candidate (capacity-proportional routing, fixed replicas, in-flight weight sync)."""
    by_name = {t.name: t for t in types}
    # each type's group as planned (the layout search's GPUs recorded; the smallest-TP ones keep tp = 0)
    groups = tuple(replace(by_name[g].group, name=g, replicas=r, min_replicas=r, max_replicas=r)
                   for g, r in c.replicas.items())
    wl = load_workload(cfg.workload)
    cat = load_catalog(cfg.price_table)
    used = {cat.accelerator(a).name for a in [cfg.trainer_accelerator, *(g.accelerator for g in groups)]}
    return Plan(name=name, groups=groups, seed=cfg.seed, model=cfg.model, workload=cfg.workload,
                cost_backend=cfg.backend,
                price_table=cfg.price_table, description=f"mixfleet plan ({cfg.objective})",
                prices={a: usd for a, usd in cfg.prices.items() if a in used},
                trainer=TrainerPlan(accelerator=cfg.trainer_accelerator, gpus=cfg.trainer_gpus),
                faults=FaultsPlan(on_loss=cfg.on_loss, spot_preemptions_per_replica_hour=cfg.spot_preemptions_per_hour),
                policies=PoliciesPlan(batcher=PolicyRef(name="fifo", settings={
                    "prompts_per_update": wl.prompts_per_update, "samples_per_prompt": wl.samples_per_prompt,
                    "inflight_prompts": c.inflight_prompts})))


def sequential_map(fn: Callable[..., dict[str, Any]], jobs: list[tuple[Any, ...]]
                   ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The twin checks one after another in this process (the reference path; `CheckMap`'s contract: the results
    in the jobs' order, and what ran them)."""
    return [fn(*job) for job in jobs], {"mode": "sequential", "workers": 1, "nodes": 1}


def plan_mix(cfg: PlannerConfig, progress: Callable[[str], None] | None = None, *,
             check_map: CheckMap | None = None) -> PlanResult:
    """Screen, pick the best feasible candidate by the objective, verify the top few in the DES.
    check_map: runs the twin checks (`twin_check` jobs) and says what ran them; default `twin.checks.default_map`
    (this machine's cores, results cached on disk by their inputs' digest; the same results as `sequential_map`)
    (`mixfleet.runner.orchestration.ray_map.ray_map` runs them as Ray tasks, with the same results)."""
    say = progress or (lambda _m: None)
    say("group types")
    types = group_types(cfg)
    if not types:
        return PlanResult(best=None, plan=None, pareto=[], screened=0, feasible=0, types=[],
                          note="no (accelerator, precision) in the pool fits the model")
    say(f"screening ({len(types)} group types)")
    n, k, m = screen(types, cfg)
    ok = feasible(m, cfg)
    idx = np.flatnonzero(ok)
    if not len(idx):
        return PlanResult(best=None, plan=None, pareto=[], screened=len(n), feasible=0, types=types,
                          note=binding_constraints(m, cfg))
    obj = m[cfg.objective][idx]
    order = idx[np.lexsort((m["time_per_update_s"][idx], obj))]
    pts = np.stack([m["cost_per_update"][idx], m["time_per_update_s"][idx], m["staleness"][idx]], axis=1)
    par = idx[pareto_mask(pts)]
    par = par[np.argsort(m["cost_per_update"][par])]
    pareto = [_candidate(types, n[i], k[i], m, i) for i in par]
    top = [_candidate(types, n[i], k[i], m, i) for i in order[:max(cfg.verify, 1)]]
    on_demand = None
    if cfg.spot:   # the best mix without spot groups, for "with and without spot"
        spot_cols = np.array([t.spot for t in types])
        od = order[~(n[order][:, spot_cols] > 0).any(1)] if spot_cols.any() else order
        on_demand = _candidate(types, n[od[0]], k[od[0]], m, od[0]) if len(od) else None
    verified: list[Candidate] = []
    checks: dict[str, Any] = {}
    if cfg.verify:
        to_check = top[:cfg.verify]
        if on_demand is not None and on_demand not in to_check:
            to_check = [*to_check, on_demand]
        say(f"verifying {len(to_check)} candidates x {cfg.verify_seeds} seeds in the twin's steady state")
        done, checks = verify_candidates(to_check, types, cfg, check_map=check_map)
        if on_demand is not None:
            on_demand = done[to_check.index(on_demand)]
        verified = done[:len(top[:cfg.verify])]
        verified.sort(key=lambda c: _twin_rank(c, cfg))  # the twin's steady state decides among them
        top = verified + top[cfg.verify:]
    best = top[0]
    if cfg.spot:
        best = replace(best, lost_work=expected_lost_work(best, types, cfg))
        if on_demand is not None:
            on_demand = replace(on_demand, lost_work=expected_lost_work(on_demand, types, cfg))
    by_name, gpus = {t.name: t for t in types}, {}
    for g, c in best.replicas.items():   # the chosen mix's GPUs per accelerator (its caps may bind)
        gpus[by_name[g].accelerator] = gpus.get(by_name[g].accelerator, 0) + c * by_name[g].tp
    return PlanResult(best=best, plan=candidate_plan(best, types, cfg), pareto=pareto, screened=len(n),
                      feasible=int(ok.sum()), types=types, verified=verified, on_demand=on_demand, checks=checks,
                      binds=what_binds(m, cfg, int(order[0]), gpus))


def verify_updates(c: Candidate, cfg: PlannerConfig, prompts_per_update: int) -> int:
    """Updates of a verification run: `cfg.verify_updates`, or (0) 10 + K / B: a warm start (`simulate`'s
    `warm_start`) still settles over about one prompt-group lifetime (K / B updates), then ~10 steady updates."""
    if cfg.verify_updates:
        return cfg.verify_updates
    return int(10 + math.ceil(c.inflight_prompts / prompts_per_update))


def twin_check(plan: dict[str, Any], updates: int, seed: int, calibration: Any = None) -> dict[str, Any]:
    """One twin check, a job any worker can run: the plan (as `Plan.to_dict`) simulated from a warm start for
    `updates` updates on `seed`; its steady-state figures (costmodel's analysis: means and 95% half-widths) and
    the preemption losses the twin saw (turns cut by a lost replica, trajectories restarted)."""
    from mixfleet.twin.sim import simulate

    r = simulate(plan_from_dict(plan), updates=updates, seed=seed, calibration=calibration, warm_start=True)
    s = r.summary
    return {"time_per_update_s": s.steady_time_per_update_s, "time_per_update_ci_s": s.steady_time_per_update_ci_s,
            "cost_per_update_usd": s.steady_cost_per_update_usd,
            "cost_per_update_ci_usd": s.steady_cost_per_update_ci_usd,
            "cost_sampler_per_update_usd": s.steady_cost_sampler_per_update_usd,
            "cost_sampler_per_update_ci_usd": s.steady_cost_sampler_per_update_ci_usd,
            "extreme_share": s.extreme_share, "staleness": s.steady_staleness_mean,
            "staleness_ci": s.steady_staleness_ci,
            "tokens_per_s": s.steady_tokens_per_s, "fill_s": s.first_update_s, "updates": updates,
            "warmup_updates": s.warmup_updates, "steady_updates": s.steady_updates, "seed": seed,
            "turns_lost": r.turns_lost, "sessions_restarted": r.sessions_restarted}


_MEANS = ("time_per_update_s", "cost_per_update_usd", "cost_sampler_per_update_usd", "staleness", "tokens_per_s",
          "fill_s", "turns_lost", "sessions_restarted")
_HALF_WIDTHS = {"time_per_update_ci_s": "time_per_update_s", "cost_per_update_ci_usd": "cost_per_update_usd",
                "cost_sampler_per_update_ci_usd": "cost_sampler_per_update_usd", "staleness_ci": "staleness"}


def _verified(c: Candidate, runs: list[dict[str, Any]], cfg: PlannerConfig) -> Candidate:
    """The candidate with `verified` filled from its twin checks (one per seed): each figure the mean over the
    seeds, each 95% half-width sqrt(sum of the seeds' squared half-widths) / seeds (independent runs); one seed
    gives that run's figures as they are. `seeds` keeps every run."""
    if len(runs) == 1:
        v = {k: runs[0][k] for k in (*_MEANS, *_HALF_WIDTHS)}
        ext = runs[0]["extreme_share"]
    else:
        v = {k: float(np.mean([r[k] for r in runs])) for k in _MEANS}
        v.update({k: float(math.sqrt(sum(r[k] ** 2 for r in runs)) / len(runs)) for k in _HALF_WIDTHS})
        ext = float(np.mean([r["extreme_share"] for r in runs]))
    kept = 1.0 - ext if math.isfinite(ext) else c.kept_share
    v.update(cost_per_effective_update_usd=v["cost_per_update_usd"] / kept, updates=runs[0]["updates"],
             warmup_updates=max(r["warmup_updates"] for r in runs),
             steady_updates=min(r["steady_updates"] for r in runs))
    v["feasible"] = bool(feasible({"cost_per_update": np.array([v["cost_per_update_usd"]]),
                                    "staleness": np.array([v["staleness"]]),
                                    "time_per_update_s": np.array([v["time_per_update_s"]]),
                                    "usd_per_hour": np.array([c.usd_per_hour])}, cfg)[0])
    if len(runs) > 1:
        v["seeds"] = [{k: r[k] for k in ("seed", "time_per_update_s", "cost_per_update_usd", "staleness")}
                      for r in runs]
    return Candidate(**{**{f: getattr(c, f) for f in c.__dataclass_fields__}, "verified": v})


def verify_candidates(cands: list[Candidate], types: list[GroupType], cfg: PlannerConfig, *,
                      check_map: CheckMap | None = None) -> tuple[list[Candidate], dict[str, Any]]:
    """Every candidate verified on `cfg.verify_seeds` seeds (cfg.seed, cfg.seed + 1, ...): one `twin_check` job per
    (candidate, seed), all handed to `check_map` at once (default `twin.checks.default_map`: on this machine's
    cores, each result kept on disk under its inputs' digest; the same results as `sequential_map`), then combined
    per candidate
    (`_verified`). Returns the candidates in their order and what ran the checks (mode, tasks, workers, nodes,
    wall_s)."""
    import time

    ppu = load_workload(cfg.workload).prompts_per_update
    seeds = [cfg.seed + i for i in range(cfg.verify_seeds)]
    jobs = [(candidate_plan(c, types, cfg).to_dict(), verify_updates(c, cfg, ppu), seed, cfg.calibration)
            for c in cands for seed in seeds]
    wall0 = time.perf_counter()
    if check_map is None:   # this machine's cores, each check read back when its inputs were checked before
        from mixfleet.twin.checks import default_map

        check_map = default_map
    runs, info = check_map(twin_check, jobs)
    info = {**info, "tasks": len(jobs), "wall_s": time.perf_counter() - wall0}
    per = len(seeds)
    return [_verified(c, runs[i * per:(i + 1) * per], cfg) for i, c in enumerate(cands)], info


def verify_candidate(c: Candidate, types: list[GroupType], cfg: PlannerConfig) -> Candidate:
    """The candidate with `verified` filled from twin runs' steady state on `cfg.verify_seeds` seeds (in this
    process; `verify_candidates` for many at once)."""
    return verify_candidates([c], types, cfg)[0][0]


def expected_lost_work(c: Candidate, types: list[GroupType], cfg: PlannerConfig) -> dict[str, Any]:
    """What preemptions are expected to cost the candidate per update (the screen's model, `type_from`): the
    preemptions (replicas x rate x time per update), the replica-seconds they lose (each: the replacement's cold
    start and weight load plus the work in flight as `cfg.on_loss` treats it), that as a share of the fleet's
    replica-seconds, and the USD those lost seconds were billed. The time per update is the twin's when the
    candidate was verified, else the screen's."""
    by = {t.name: t for t in types}
    t_update = c.verified.get("time_per_update_s", c.time_per_update_s) if c.verified else c.time_per_update_s
    pre = lost_s = usd = 0.0
    reps = 0
    for g, r in c.replicas.items():
        t = by[g]
        reps += r
        events = r * t.preemptions_per_hour * t_update / 3600.0
        pre += events
        lost_s += events * (t.replace_s + t.inflight_loss_s)
        usd += events * (t.replace_s + t.inflight_loss_s) * t.usd_per_hour / 3600.0
    spot = {g: r for g, r in c.replicas.items() if by[g].spot}
    return {"on_loss": cfg.on_loss, "spot_replicas": spot, "preemptions_per_update": pre,
            "lost_replica_s_per_update": lost_s, "lost_share": lost_s / max(reps * t_update, 1e-12),
            "lost_usd_per_update": usd, "time_per_update_s": t_update}


def _twin_rank(c: Candidate, cfg: PlannerConfig) -> tuple[bool, float, float]:
    """Verified candidates by the twin: those meeting the constraints in the twin first, then the objective."""
    v = c.verified
    key = "cost_per_update_usd" if cfg.objective == "cost_per_update" else "cost_per_effective_update_usd"
    obj = v[key] if math.isfinite(v[key]) else math.inf
    return (not v["feasible"], obj, v["time_per_update_s"])
