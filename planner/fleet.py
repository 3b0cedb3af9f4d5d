"""The planner's analytic fleet model: candidate group types, their busy rates, and a mix's throughput, time per
update, staleness and cost (vectorized over thousands of mixes).

1. Candidate group types: every accelerator in the pool x every precision it runs natively (x KV dtypes), that
   fits the model, priced by costmodel's one group record (`planspec.resolve_group`, the twin's: replica model
   prior or calibrated, TP, KV capacity, price, weight sync, mismatch), with its busy throughput
   (`ReplicaModel.operating_point` at `planner_load`): the batch its KV holds of the running set (up to the
   engine's cap) and the step time at that set's context. The running set is the workload's turns weighted by
   their reply tokens (a replica decodes all running requests at one rate, so a request holds KV for a time
   proportional to its reply): long, late turns of long episodes, about 1.3x the mean turn's context on the seed
   workload (`planner.shape.workload_shape`, measured on the twin's own episode draws, the max_context cut
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
   the tokens it wastes (`feasible`: the planner's and the re-planner's one rule for the limits).

The search over mixes is planner/search.py; spot accounting planner/spot.py; the workload's shape planner/shape.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.plan.planspec import ResolvedGroup, group_calibration, resolve_group, resolve_trainer
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
from mixfleet.planner.config import PlannerConfig, pool_catalog
from mixfleet.planner.shape import WorkloadShape, workload_shape
from mixfleet.policies.plan import GroupPlan

MAX_LOSS_SHARE = 0.9               # a spot replica loses at most this share of its time to preemptions
SPOT_SUFFIX = "-SPOT"


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
    cat = pool_catalog(cfg)
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
    cat = pool_catalog(cfg)
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
    per request (reply-weighted, `planner.shape.workload_shape`), one turn's new tokens per turn's reply, and
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



def metrics(types: list[GroupType], n: np.ndarray, k: np.ndarray, cfg: PlannerConfig,
            update_shape: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """The analytic model for mixes `n` (rows: replicas per type) with `k` prompts in flight (vectorized).
    update_shape: (prompts per update, samples per prompt) when not the workload's."""
    cat = pool_catalog(cfg)
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
    unfinished = k * spp / shape.group_span        # episodes in flight not waiting for their siblings
    if cfg.sandboxes:
        thr, held, episode_s = sandbox_limited(types, n, unfinished, reply, tool, shape.generated_per_episode, cfg)
    else:
        thr = session_limited_throughput(types, n, unfinished, reply, tool)  # siblings wait
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
    with np.errstate(invalid="ignore"):   # an empty fleet (the re-planner's rows) never finishes: 0 x inf
        sampling = (n @ price) * t_update / 3600.0
    out = {"cost_sampling_per_update": sampling, "cost_training_per_update": trainer_usd_h * t_update / 3600.0,
           "cost_sandbox_per_update": np.zeros(len(cost)), "sandbox_wait_share": np.zeros(len(cost)),
           "sandboxes_live": np.zeros(len(cost))}
    if cfg.sandboxes:   # every episode of an update holds a sandbox for its start + its run (Little's law)
        sandbox_s = ppu * spp * (cfg.sandbox_start_s + episode_s)
        out["cost_sandbox_per_update"] = sandbox_s * cfg.sandbox_price() / 3600.0
        out["sandboxes_live"] = sandbox_s / t_update
        out["sandbox_wait_share"] = 1.0 - held / np.maximum(unfinished, 1e-12)
        cost = cost + out["cost_sandbox_per_update"]
        usd_h = usd_h + out["sandboxes_live"] * cfg.sandbox_price()   # the budget (--budget) covers them too
    kept = 1.0 - (n * tps) @ masked / np.maximum(cap_tps, 1e-12)
    return {"throughput": thr, "time_per_update_s": t_update, "staleness": staleness, "usd_per_hour": usd_h,
            "cost_per_update": cost, "cost_per_effective_update": cost / kept, "kept_share": kept,
            "trainer_bound": trainer_bound, **out}


SANDBOX_ITERATIONS = 30


def sandbox_limited(types: list[GroupType], n: np.ndarray, unfinished: np.ndarray, reply: float, tool_s: float,
                    tokens_per_episode: float, cfg: PlannerConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fleet tokens/s when every episode holds a sandbox (issue 42): of the `unfinished` episodes in flight,
    min(unfinished, cap) hold one (the others wait for one: the pool's queue), and of those a share
    start / (start + D) are still starting it, where D is an episode's run once started; the rest generate
    (`session_limited_throughput`). D = tokens per episode x generating sessions / fleet tokens/s (Little's
    law on the sessions), a fixed point (damped). Returns (tokens/s, sandboxes held, D in seconds)."""
    cap = math.inf if cfg.sandbox_cap is None else float(cfg.sandbox_cap)
    held = np.minimum(np.asarray(unfinished, dtype=np.float64), cap)
    start = float(cfg.sandbox_start_s)
    active = held.copy()
    for _ in range(SANDBOX_ITERATIONS if start > 0 else 1):
        thr = session_limited_throughput(types, n, active, reply, tool_s)
        run_s = tokens_per_episode * active / np.maximum(thr, 1e-12)
        active = 0.5 * active + 0.5 * held * run_s / np.maximum(run_s + start, 1e-12)
    thr = session_limited_throughput(types, n, active, reply, tool_s)
    return thr, held, tokens_per_episode * active / np.maximum(thr, 1e-12)


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

