"""A plan's plain data: its groups, trainer, faults, embedded settings, model, workload and prices, checked
field by field when the plan loads, and the TOML files with their `base` chains. Everything here but
the policies (their names and settings are checked by policies/plan.py, which builds the full `Plan` on
top of `PlanData` and re-exports what is here); it sits in costmodel so that the calibration reads a run
log's plan with the very schema that wrote it, and so that "plan group -> replica cost model" is one
function (`group_replica_model`) for the twin, the planner, the runner's fleet and the calibration, and
"plan group -> everything a world needs to price it" one record (`resolve_groups`, `ResolvedGroup`: the
replica model, prior or calibrated, weight-sync seconds, mismatch, the engine's running cap, the nominal
point) for the twin's setup and the planner's candidate types alike. Those (the plan's resolution:
group_replica_model, running_cap, nominal_point, group_calibration, resolve_group(s), plan_catalog,
resolve_trainer) are costmodel/plan/resolve.py, re-exported here.

Variants derive from a named base: a plan file may say `base = "seed-mixed"` (a shipped plan name or a path
relative to the file) and give only what differs; tables merge key by key, `[[groups]]` merge by `name` (a
new name appends a group, `remove = true` drops one). `merge()` is the one place this happens.

Schema (every field optional unless marked; `model` and `workload` may come from the base):
    name* description seed cost_backend model* workload* price_table
    [prices]   ACCELERATOR = USD per GPU-hour, overriding the price table (e.g. H100 = 3.0)
    [trainer]  accelerator gpus precision loss top_p top_p_replay routing
    [[groups]] name* accelerator* precision* kv_dtype kernel weight_noise replicas min_replicas max_replicas
               tp emulated dp_attention ep spot   (the layout, SGLang's meaning: tp GPUs, attention DP groups,
               expert parallel; spot: the price table's spot price, preempted at the catalog's rate)
    [policies.router|autoscaler|batcher|weight_sync]  name + that policy's settings (policies/plan.py)
    [faults]   preemptions_per_replica_hour on_loss spot_preemptions_per_replica_hour
    [sandbox]  max_live* start_s price_per_hour_usd source date   (one sandbox per live episode, from a pool of
               max_live; start_s its start latency; the price per sandbox-hour, default the catalog's [sandbox]
               price; a plan without the table has no sandboxes: no start, no wait, no sandbox cost)
    [embedded] settings for rehearsing the plan on this machine (see EmbeddedPlan)
Formats (`precision`, `kv_dtype`, `kernel`) are checked against data/precisions.toml (costmodel/specs/formats.py),
accelerators against data/accelerators.toml (a name in another case is taken as the catalog spells it),
counts against costmodel/limits.py.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.limits import (
    MAX_BASE_STEPS,
    MAX_GPUS,
    MAX_LOCAL_REPLICAS,
    MAX_NEW_TOKENS,
    MAX_PASS_K,
    MAX_REPLICAS_PER_GROUP,
    MAX_THREADS,
    MAX_TURNS,
    check_count,
)
from mixfleet.costmodel.paths import data_path
from mixfleet.costmodel.plan.resolve import (  # noqa: F401 - re-exported: the plan's resolution, public API
    ResolvedGroup,
    ResolvedSandbox,
    ResolvedTrainer,
    group_calibration,
    group_replica_model,
    nominal_point,
    plan_catalog,
    resolve_group,
    resolve_groups,
    resolve_plan_sandbox,
    resolve_sandbox,
    resolve_trainer,
    running_cap,
)
from mixfleet.costmodel.specs.catalog import TP_SIZES, load_catalog
from mixfleet.costmodel.specs.formats import formats
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.costmodel.tomlread import read_toml

LOSSES = ("grpo", "mis", "sc", "sc_mis")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean")   # how per-token losses become one (runner/corrections/loss.py)
ROUTING_MODES = ("free", "replay")   # MoE trainer: its own router | rollout routing replay (the samplers' experts)
ON_LOSS = ("resume", "restart")
COST_BACKENDS = ("roofline", "auto", "aiconfigurator")
POLICY_KINDS = ("router", "autoscaler", "batcher", "weight_sync")
NOISE_TAG = "+noise"                 # the retired spelling of the emulated kernel error inside `kernel`
MAX_WEIGHT_NOISE = 10.0              # the engine's bound on the emulated kernel error (relative std)


def _need(where: str, name: str, ok: bool, value: Any, allowed: str) -> None:
    if not ok:
        raise SpecError(where, name, value, allowed)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _accelerator(where: str, field_name: str, name: Any) -> str:
    """The catalog's spelling of an accelerator name ('h100' -> 'H100'); an unknown one lists the known."""
    if not isinstance(name, str) or not name:
        raise SpecError(where, field_name, name, list(load_catalog().accelerators))
    try:
        return load_catalog().accelerator(name).name
    except SpecError:
        raise SpecError(where, field_name, name, list(load_catalog().accelerators)) from None


def _check_support(where: str, accelerator: str, precision: str, emulated: Any) -> None:
    """A precision the accelerator cannot run is refused; one it only emulates needs `emulated = true` (as the
    cost model refuses it in the twin, the planner and the runner's fleet alike)."""
    cat = load_catalog()
    support = cat.support(accelerator, precision)
    arch = cat.accelerator(accelerator).arch
    if support == "unsupported":
        raise SpecError(where, "precision", precision, f"a precision {accelerator} ({arch}) can run: " + ", ".join(
            p for p in cat.precisions if cat.support(accelerator, p) != "unsupported"))
    if support == "emulated" and emulated is not True:
        native = ", ".join(p for p in cat.precisions if cat.support(accelerator, p) == "native") or "none"
        raise SpecError(where, "emulated", emulated, f"true to emulate {precision} on {accelerator} ({arch}: no "
                        f"native support, slower), or a native precision: {native}")


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """One sampler group: replicas of one (accelerator, precision) with one KV dtype."""
    name: str                        # unique within the plan, e.g. "H100-FP8"
    accelerator: str                 # a catalog name, e.g. "H100" (or "CPU-2core" for embedded runs)
    precision: str                   # weights: a precision of data/precisions.toml ("bf16", "fp8", "nvfp4", ...)
    kv_dtype: str = "fp8_e4m3"       # KV cache: a KV dtype of data/precisions.toml
    kernel: str = ""                 # embedded engine's compute dtype (e.g. "fp32"); "" = precision's own
    weight_noise: float = 0.0        # embedded engine's emulated kernel error (relative std; the ablation's knob)
    replicas: int = 1                # replicas at start
    min_replicas: int | None = None  # autoscaler floor (default: replicas)
    max_replicas: int | None = None  # autoscaler cap (default: replicas)
    tp: int = 0                      # GPUs per replica; 0 = the smallest that fits (cost model)
    emulated: bool = False           # allow a precision the accelerator lacks natively (runs slower)
    dp_attention: int = 1            # attention data-parallel groups over the tp GPUs (SGLang --dp-size)
    ep: int = 1                      # expert-parallel size (SGLang --ep-size); 1 = experts tensor-parallel
    spot: bool = False               # spot / preemptible capacity: the price table's spot price, and the twin
                                     # preempts its replicas at the catalog's rate (or [faults]' spot rate)

    def __post_init__(self) -> None:
        w = f"plan group '{self.name}'"
        _need(w, "name", isinstance(self.name, str) and bool(self.name), self.name, "a non-empty string")
        object.__setattr__(self, "accelerator", _accelerator(w, "accelerator", self.accelerator))
        reg = formats()
        reg.check_precision(w, self.precision)
        reg.check_kv_dtype(w, self.kv_dtype)
        _check_support(w, self.accelerator, self.precision, self.emulated)
        if isinstance(self.kernel, str) and NOISE_TAG in self.kernel:
            dtype, _, value = self.kernel.partition(NOISE_TAG)
            raise SpecError(w, "kernel", self.kernel, f"one of {', '.join(map(repr, reg.kernels))} or \"\"; the "
                            f"emulated kernel error is its own field now: kernel = {dtype or 'bf16'!r}, "
                            f"weight_noise = {value or '<relative std>'}")
        if self.kernel != "":
            reg.check(w, "kernel", self.kernel, ("",) + reg.kernels)
        _need(w, "weight_noise", _number(self.weight_noise) and 0 <= self.weight_noise < MAX_WEIGHT_NOISE,
              self.weight_noise, f"a number in [0, {MAX_WEIGHT_NOISE:g}) (0 = off)")
        check_count(w, "replicas", self.replicas, 0, MAX_REPLICAS_PER_GROUP)
        _need(w, "tp", not isinstance(self.tp, bool) and self.tp in (0,) + TP_SIZES, self.tp,
              "0 (auto) or one of " + ", ".join(map(str, TP_SIZES)))
        _need(w, "emulated", isinstance(self.emulated, bool), self.emulated, "true or false")
        _need(w, "spot", isinstance(self.spot, bool), self.spot, "true or false")
        check_count(w, "dp_attention", self.dp_attention, 1, max(TP_SIZES))
        check_count(w, "ep", self.ep, 1, max(TP_SIZES))
        if self.dp_attention > 1 or self.ep > 1:
            _need(w, "tp", self.tp > 0 and self.tp % self.dp_attention == 0 and self.tp % self.ep == 0, self.tp,
                  f"GPUs per replica divisible by dp_attention ({self.dp_attention}) and ep ({self.ep})")
        if self.min_replicas is None:
            object.__setattr__(self, "min_replicas", self.replicas)
        if self.max_replicas is None:
            object.__setattr__(self, "max_replicas", self.replicas)
        check_count(w, "min_replicas", self.min_replicas, 0, self.replicas, f" (0..replicas = {self.replicas})")
        check_count(w, "max_replicas", self.max_replicas, self.replicas, MAX_REPLICAS_PER_GROUP,
                    " (replicas..the limit)")

    @property
    def layout(self) -> Any:
        """The cost model's Layout for an explicit attention-DP / expert-parallel group, else None (plain TP,
        `tp` GPUs or the smallest that fits)."""
        if self.dp_attention == 1 and self.ep == 1:
            return None
        from mixfleet.costmodel.steptime.measured import Layout

        return Layout(tp=self.tp // self.dp_attention, dp_attention=self.dp_attention, ep=self.ep)


@dataclass(frozen=True, kw_only=True)
class TrainerPlan:
    """The trainer: BF16 on `gpus` GPUs of one accelerator, and its loss."""
    accelerator: str = "B200"
    gpus: int = 8
    precision: str = "bf16"
    loss: str = "sc_mis"             # "grpo" | "mis" | "sc" | "sc_mis" (CORRECTIONS.md)
    top_p: float = 1.0               # the samplers' top-p (1.0 = full sampling)
    top_p_replay: bool = False       # the trainer replays the samplers' top-p mask
    routing: str = "free"            # MoE: "free" (the trainer's router) | "replay" (the samplers' recorded experts)

    def __post_init__(self) -> None:
        w = "plan trainer"
        object.__setattr__(self, "accelerator", _accelerator(w, "accelerator", self.accelerator))
        check_count(w, "gpus", self.gpus, 1, MAX_GPUS)
        formats().check_precision(w, self.precision)
        _need(w, "routing", self.routing in ROUTING_MODES, self.routing, "one of " + ", ".join(ROUTING_MODES))
        _need(w, "loss", self.loss in LOSSES, self.loss, "one of " + ", ".join(LOSSES))
        _need(w, "top_p", _number(self.top_p) and 0 < self.top_p <= 1, self.top_p, "a number in (0, 1]")
        _need(w, "top_p_replay", isinstance(self.top_p_replay, bool), self.top_p_replay, "true or false")


@dataclass(frozen=True, kw_only=True)
class FaultsPlan:
    """Fault injection (the twin): replica preemptions / crashes as a Poisson process per replica. A replica of a
    spot group (`GroupPlan.spot`) is preempted at `preemptions_per_replica_hour` plus its spot rate: this table's
    `spot_preemptions_per_replica_hour`, or (None) the catalog's rate for its accelerator (`Catalog.spot`)."""
    preemptions_per_replica_hour: float = 0.0
    on_loss: str = "resume"          # a lost session "resume"s on a new replica (re-prefills) or "restart"s
    spot_preemptions_per_replica_hour: float | None = None   # spot groups' rate (None: the catalog's)

    def __post_init__(self) -> None:
        for f in ("preemptions_per_replica_hour", "spot_preemptions_per_replica_hour"):
            v = getattr(self, f)
            if v is None and f.startswith("spot"):
                continue
            _need("plan faults", f, _number(v) and 0 <= v <= 3600, v, "a number in [0, 3600] (per replica-hour)")
        _need("plan faults", "on_loss", self.on_loss in ON_LOSS, self.on_loss, "one of " + ", ".join(ON_LOSS))


MAX_SANDBOXES = 10_000_000          # a plan's sandbox pool (the published run used thousands)
MAX_SANDBOX_START_S = 3600.0


@dataclass(frozen=True, kw_only=True)
class SandboxPlan:
    """Sandboxes as a resource: each episode takes one from a pool of `max_live` (waits while all are live),
    pays `start_s` before its first turn (None: the workload's `sandbox_start_s` mean when it has one, else 0;
    `resolve_sandbox`) and holds it until its last turn ends; a live sandbox (starting included) costs
    `price_per_hour_usd` (None: the catalog's [sandbox] price, `resolve_sandbox`). `source` / `date`: where the
    figures come from (an estimate says so)."""
    max_live: int
    start_s: float | None = None
    price_per_hour_usd: float | None = None
    source: str = ""
    date: str = ""

    def __post_init__(self) -> None:
        w = "plan sandbox"
        check_count(w, "max_live", self.max_live, 1, MAX_SANDBOXES)
        st = self.start_s
        _need(w, "start_s", st is None or (_number(st) and 0 <= st <= MAX_SANDBOX_START_S), st,
              f"a number of seconds in [0, {MAX_SANDBOX_START_S:g}] (or absent: the workload's "
              "sandbox_start_s mean, else 0)")
        p = self.price_per_hour_usd
        _need(w, "price_per_hour_usd", p is None or (_number(p) and 0 <= p < 1e6), p,
              "USD per sandbox-hour, a number >= 0 (or absent: the catalog's [sandbox] price)")
        for f in ("source", "date"):
            _need(w, f, isinstance(getattr(self, f), str), getattr(self, f), "a string")


REPO_TASK = "repo"                  # the runner's task whose sandbox pool size is embedded.task_options.sandboxes


def plan_sandbox(plan: PlanData) -> SandboxPlan | None:
    """The plan's sandboxes, their cap declared once. A plan whose embedded task is `repo` runs real sandboxes
    from a pool of `embedded.task_options.sandboxes` (the runner's pool reads it), so that is the cap: without a
    [sandbox] table such a plan has `SandboxPlan(max_live=task_options.sandboxes)` (start and price as
    `resolve_sandbox` fills them); with one, its `max_live` must equal task_options.sandboxes (a SpecError naming
    both otherwise, and when the repo plan leaves task_options.sandboxes out: the real pool would not be the
    table's). Any other plan: its [sandbox] table or None."""
    sb, emb = plan.sandbox, plan.embedded
    if emb is None or emb.task != REPO_TASK:
        return sb
    n = (emb.task_options or {}).get("sandboxes")
    if n is None:
        if sb is None:
            return None
        raise SpecError(f"plan '{plan.name}' sandbox", "max_live", sb.max_live,
                        f"the repo task's pool size, embedded.task_options.sandboxes (not set: the real pool would "
                        f"not be {sb.max_live}); set task_options.sandboxes = {sb.max_live} and leave max_live out")
    if sb is None:
        return SandboxPlan(max_live=n, source="the repo task's pool (embedded.task_options.sandboxes)")
    if sb.max_live != n:
        raise SpecError(f"plan '{plan.name}' sandbox", "max_live", sb.max_live,
                        f"{n}, the repo task's pool size embedded.task_options.sandboxes (the cap is declared once: "
                        "the real pool reads task_options.sandboxes)")
    return sb


@dataclass(frozen=True, kw_only=True)
class EmbeddedPlan:
    """The plan's run settings (read by the runner): rehearsing it on this machine with embedded samplers (each
    group becomes min(replicas, max_replicas_per_group) embedded samplers in its precision, KV dtype and kernel;
    the policies are the plan's), the episodes, the held-out evaluation and the trainer's recipe. The one owner
    of these settings and their one check: a run changes one with a dotted override of its plan (`mixfleet run
    --set embedded.lr=1.5e-4`, runner/orchestration/recipe.py), which goes into the run's own plan and run log."""
    max_replicas_per_group: int = 1  # scale each group down to at most this many local samplers
    threads_per_replica: int = 1     # torch threads per embedded sampler
    max_turns: int = 8               # episode turn cap
    max_new_tokens: int = 64         # reply tokens per turn cap
    temperature: float = 1.0
    task: str = ""                   # the runner's task name ("" = its default)
    task_options: dict[str, Any] = field(default_factory=dict)   # the task's own options (its config's fields)
    eval_every: int = 0              # updates between pass@k evaluations (0 = never)
    eval_at_start: bool = True       # also evaluate the base policy (when eval_every > 0)
    eval_problems: int = 8           # held-out problems per evaluation
    pass_k: int = 4
    eval_top_p: float = 1.0          # the evaluation's nucleus: 1 = the full vocabulary (the seed's); a top-p run's
                                     # trainer.top_p evaluates the nucleus policy it trains (docs/learning.md)
    lr: float = 1e-4                 # the trainer's learning rate (AdamW)
    lr_warmup_steps: int = 0         # linear warm-up of the learning rate over the first updates
    grad_clip_norm: float = 1.0
    loss_agg: str = "token_mean"     # LOSS_AGGS: token_mean | seq_mean_token_mean (runner/corrections/loss.py)
    advantage_std: bool = False      # GRPO advantages divided by their prompt-group's std
    top_k_record: int = 16           # top-K log-probs recorded per sampled token (the corrections' head)
    trainer_threads: int = 1         # torch threads of the trainer
    base_steps: int = 0              # the base policy's pretraining steps when a run is given none (`mixfleet run`
                                     # without --init pretrains or reuses `mixfleet pretrain --steps N` on the plan's
                                     # model and task); 0 = pretrain's default. Not a run setting: --init replaces it

    def __post_init__(self) -> None:
        w = "plan embedded"
        for f, hi in (("max_replicas_per_group", MAX_LOCAL_REPLICAS), ("threads_per_replica", MAX_THREADS),
                      ("max_turns", MAX_TURNS), ("max_new_tokens", MAX_NEW_TOKENS), ("pass_k", MAX_PASS_K),
                      ("trainer_threads", MAX_THREADS), ("eval_problems", 1_000_000)):
            check_count(w, f, getattr(self, f), 1, hi)
        check_count(w, "eval_every", self.eval_every, 0, 1_000_000)
        check_count(w, "lr_warmup_steps", self.lr_warmup_steps, 0, 1_000_000)
        check_count(w, "top_k_record", self.top_k_record, 0, 1024)
        check_count(w, "base_steps", self.base_steps, 0, MAX_BASE_STEPS)
        _need(w, "temperature", _number(self.temperature) and 0 < self.temperature <= 100, self.temperature,
              "a number in (0, 100]")
        _need(w, "lr", _number(self.lr) and self.lr > 0, self.lr, "a number > 0")
        _need(w, "eval_top_p", _number(self.eval_top_p) and 0 < self.eval_top_p <= 1, self.eval_top_p,
              "a number in (0, 1]")
        _need(w, "grad_clip_norm", _number(self.grad_clip_norm) and self.grad_clip_norm > 0, self.grad_clip_norm,
              "a number > 0")
        _need(w, "task", isinstance(self.task, str), self.task, "a task name (\"\" = the runner's default)")
        _need(w, "loss_agg", self.loss_agg in LOSS_AGGS, self.loss_agg, "one of " + ", ".join(LOSS_AGGS))
        for f in ("advantage_std", "eval_at_start"):
            _need(w, f, isinstance(getattr(self, f), bool), getattr(self, f), "true or false")
        _need(w, "task_options", isinstance(self.task_options, dict), self.task_options,
              "a table of the task's options")


def embedded_table(raw: Any, where: str) -> Any:
    """The [embedded] table with a legacy `[embedded.extra]` (plans and run logs written before issue 25) lifted
    into its own fields: every key of `extra` must be one of them and not given twice."""
    if not isinstance(raw, dict) or "extra" not in raw:
        return raw
    out = {k: v for k, v in raw.items() if k != "extra"}
    extra = raw["extra"]
    if not isinstance(extra, dict):
        raise SpecError(where, "extra", extra, "a table of [embedded] settings (better: the settings themselves)")
    known = [f.name for f in fields(EmbeddedPlan)]
    for key, value in extra.items():
        if key not in known:
            raise SpecError(where, f"extra.{key}", value, "one of the [embedded] settings: " + ", ".join(known))
        if key in out:
            raise SpecError(where, f"extra.{key}", value, f"given once (it is also [embedded] {key})")
        out[key] = value
    return out


@dataclass(frozen=True, kw_only=True)
class PlanData:
    """A plan without its policies (policies/plan.py's `Plan` adds them)."""
    name: str
    groups: tuple[GroupPlan, ...]
    model: str                       # a shipped model name or a TOML path (required, or from the base)
    workload: str                    # a shipped workload name or a TOML path (required, or from the base)
    description: str = ""
    seed: int = 0
    cost_backend: str = "roofline"   # step times: "roofline" | "auto" (measured where covered) | "aiconfigurator"
    price_table: str = ""            # "" = the catalog's default price table
    prices: dict[str, float] = field(default_factory=dict)  # accelerator -> USD per GPU-hour, over the table
    trainer: TrainerPlan = field(default_factory=TrainerPlan)
    faults: FaultsPlan = field(default_factory=FaultsPlan)
    embedded: EmbeddedPlan | None = None
    sandbox: SandboxPlan | None = None   # None: no sandboxes (no start latency, no pool, no sandbox cost)

    def __post_init__(self) -> None:
        w = f"plan '{self.name}'"
        _need(w, "cost_backend", self.cost_backend in COST_BACKENDS, self.cost_backend, ", ".join(COST_BACKENDS))
        _need("plan", "name", isinstance(self.name, str) and bool(self.name), self.name, "a non-empty string")
        _need(w, "groups", len(self.groups) > 0, list(self.groups), "at least one [[groups]] entry")
        seen = [g.name for g in self.groups]
        dup = sorted({n for n in seen if seen.count(n) > 1})
        _need(w, "groups.name", not dup, dup, "unique group names")
        _need(w, "groups.replicas", any(g.replicas > 0 for g in self.groups), 0, "at least one group with replicas")
        for f, what in (("model", "a shipped model name or a model spec TOML path"),
                        ("workload", "a shipped workload name or a workload spec TOML path")):
            _need(w, f, isinstance(getattr(self, f), str) and bool(getattr(self, f)), getattr(self, f), what)
        _need(w, "description", isinstance(self.description, str), self.description, "a string")
        _need(w, "seed", isinstance(self.seed, int) and not isinstance(self.seed, bool) and 0 <= self.seed < 2**63,
              self.seed, "an integer in 0..2^63-1")
        tables = load_catalog().price_tables()
        _need(w, "price_table", self.price_table == "" or self.price_table in tables, self.price_table,
              "\"\" (the default) or one of " + ", ".join(tables))
        _need(w, "prices", isinstance(self.prices, dict), self.prices, "a table ACCELERATOR = USD per GPU-hour")
        prices = {}
        for acc, usd in self.prices.items():
            _need(w, f"prices.{acc}", _number(usd) and 0 < usd < 1e9, usd, "USD per GPU-hour, a number > 0")
            prices[_accelerator(w, "prices", acc)] = usd
        object.__setattr__(self, "prices", prices)
        if self.trainer.routing == "replay":
            kind = load_model_spec(self.model).kind
            _need(w, "trainer.routing", kind == "moe", self.trainer.routing,
                  f"'free' for model '{self.model}' (kind = '{kind}': routing replay needs a MoE model)")

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        raise SpecError(f"plan '{self.name}'", "group", name, [g.name for g in self.groups])

    def _to_dict(self, policies: dict[str, Any] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        for key in ("description", "seed", "model", "workload", "price_table"):
            out[key] = getattr(self, key)
        if self.cost_backend != "roofline":
            out["cost_backend"] = self.cost_backend
        if self.prices:
            out["prices"] = dict(self.prices)
        out["trainer"] = _plain(self.trainer)
        out["groups"] = [{k: v for k, v in _plain(g).items()  # fields at their defaults stay out
                          if not (k in ("min_replicas", "max_replicas") and v == g.replicas)
                          and not (k in ("dp_attention", "ep") and v == 1)
                          and not (k == "weight_noise" and v == 0)
                          and not (k == "spot" and not v)} for g in self.groups]
        if policies is not None:
            out["policies"] = policies
        out["faults"] = _plain(self.faults)
        if self.embedded is not None:
            out["embedded"] = _plain(self.embedded)
        if self.sandbox is not None:
            out["sandbox"] = _plain(self.sandbox)
        return _drop_none(out)

    def to_dict(self) -> dict[str, Any]:
        """Plain TOML-ready dict (None values omitted)."""
        return self._to_dict(None)


def _plain(obj: Any) -> dict[str, Any]:
    return {f.name: copy.deepcopy(getattr(obj, f.name)) for f in fields(obj)}


def _drop_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_none(v) for v in x]
    return x


# ---- building from dicts ------------------------------------------------------------------------------
def build_table(cls: type, raw: Any, where: str) -> Any:
    """One table of the plan as `cls` (unknown keys and missing required ones named)."""
    if not isinstance(raw, dict):
        raise SpecError(where, "<table>", raw, "a TOML table")
    known = [f.name for f in fields(cls)]
    for key in raw:
        if key not in known:
            raise SpecError(where, key, raw[key], "a known field: " + ", ".join(known))
    try:
        return cls(**raw)
    except TypeError as e:
        raise SpecError(where, "<fields>", sorted(raw), f"the required fields ({e})") from None


def plan_data_fields(raw: dict[str, Any], known: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A plan table (after base merging) -> (the keyword arguments of PlanData, the raw [policies] table).
    `known`: the field names of the class being built (for the unknown-key message)."""
    raw = dict(raw)
    raw.pop("base", None)
    if "name" not in raw:
        raise SpecError("plan", "name", None, "a value (the field is required)")
    where = f"plan '{raw['name']}'"
    groups_raw = raw.pop("groups", [])
    if not isinstance(groups_raw, list):
        raise SpecError(where, "groups", groups_raw, "an array of tables ([[groups]])")
    groups = tuple(build_table(GroupPlan, g, f"{where} groups[{i}]") for i, g in enumerate(groups_raw))
    pol_raw = raw.pop("policies", {})
    if not isinstance(pol_raw, dict):
        raise SpecError(where, "policies", pol_raw, "a table of [policies.<kind>] tables")
    sub = {"trainer": TrainerPlan, "faults": FaultsPlan, "embedded": EmbeddedPlan, "sandbox": SandboxPlan}
    if "embedded" in raw:
        raw["embedded"] = embedded_table(raw["embedded"], f"{where} [embedded]")
    kwargs = {k: build_table(cls, raw.pop(k), f"{where} [{k}]") for k, cls in sub.items() if k in raw}
    for key in raw:
        if key not in known:
            raise SpecError(where, key, raw[key], "a known field: " + ", ".join(known + ["base"]))
    for key in ("model", "workload"):
        if key not in raw:
            raise SpecError(where, key, None, f"a {key} (shipped name or spec TOML path), in this file or its base"
                                              " (the field is required)")
    return {**raw, **kwargs, "groups": groups}, pol_raw


def plan_data_from_dict(raw: dict[str, Any]) -> PlanData:
    """A plan table's plain data (the policies table is kept out, unchecked: policies/plan.py checks it)."""
    kwargs, _ = plan_data_fields(raw, [f.name for f in fields(PlanData)] + ["policies"])
    return PlanData(**kwargs)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Overlay `over` on `base`: tables key by key, `groups` by name (`remove = true` drops one)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if key == "groups":
            by_name = {g["name"]: g for g in out.get("groups", [])}
            order = [g["name"] for g in out.get("groups", [])]
            for g in value:
                name = g.get("name")
                if g.get("remove"):
                    by_name.pop(name, None)
                    order = [n for n in order if n != name]
                elif name in by_name:
                    by_name[name] = merge(by_name[name], g)
                else:
                    by_name[name] = copy.deepcopy(g)
                    order.append(name)
            out["groups"] = [by_name[n] for n in order]
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            if key in POLICY_KINDS and value.get("name", out[key].get("name")) != out[key].get("name"):
                out[key] = copy.deepcopy(value)  # another policy: its settings start afresh
            else:
                out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# ---- files ----------------------------------------------------------------------------------------------
def _resolve(ref: str, near: Path | None) -> Path:
    """A plan file: `ref` as a path or a shipped name. As a `base` (near = the folder of the plan naming it),
    only a shipped name or a .toml file inside that folder: an uploaded plan cannot make the server read (and
    echo in its errors) any other TOML file."""
    p = Path(ref)
    shipped = [data_path("plans", f"{ref}.toml")] if p.suffix != ".toml" and len(p.parts) == 1 else []
    if near is None:
        candidates = [p, *shipped]
    else:
        inside = not p.is_absolute() and ".." not in p.parts and p.suffix == ".toml" \
            and (near / p).resolve().is_relative_to(near.resolve())          # no symlink out either
        candidates = [*shipped, *([near / p] if inside else [])]
    for c in candidates:
        if c.is_file():
            return c
    if near is not None:
        raise SpecError("plan", "base", ref, "a shipped plan or a .toml file in the plan's own folder (no absolute "
                        "path, no '..'); shipped: " + ", ".join(known_plans()))
    raise SpecError("plan", "path", ref, "a plan file path or a shipped plan: " + ", ".join(known_plans()))


def known_plans() -> list[str]:
    """Shipped plan names (data/plans)."""
    return sorted(p.stem for p in data_path("plans").glob("*.toml"))


def load_plan_dict(path: str | Path, _depth: int = 0) -> dict[str, Any]:
    """The merged raw table of a plan file (its `base` chain resolved)."""
    path = _resolve(str(path), None) if not Path(path).is_file() else Path(path)
    raw = read_toml(path)
    base = raw.get("base")
    if base is None:
        return raw
    if not isinstance(base, str):
        raise SpecError(str(path), "base", base, "a string: a shipped plan name or a .toml file beside this plan")
    if _depth > 8:
        raise SpecError(str(path), "base", base, "a base chain shorter than 8 (is it circular?)")
    return merge(load_plan_dict(_resolve(base, path.parent), _depth + 1), raw)
