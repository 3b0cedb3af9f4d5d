"""The Plan: which sampler groups (accelerator x precision x KV dtype, replicas), which trainer, which
policies with which settings, on which model and workload. One TOML file; the twin simulates it, the
runner runs it, the planner writes it.

Variants derive from a named base: a plan file may say `base = "seed-mixed"` (a shipped plan/fleet
name or a path relative to the file) and give only what differs; tables merge key by key, `[[groups]]`
merge by `name` (a new name appends a group, `remove = true` drops one). `merge()` is the one place
this happens; `with_overrides(plan, {"groups.H100-FP8.replicas": 4})` uses it too.

Schema (every field optional unless marked):
    name* description seed model workload price_table
    [prices]   ACCELERATOR = USD per GPU-hour, overriding the price table (e.g. H100 = 3.0)
    [trainer]  accelerator gpus precision loss top_p top_p_replay routing
    [[groups]] name* accelerator* precision* kv_dtype kernel replicas min_replicas max_replicas tp emulated
               dp_attention ep   (the layout, SGLang's meaning: tp GPUs, attention DP groups, expert parallel)
    [policies.router|autoscaler|batcher|weight_sync]  name + that policy's settings
    [faults]   preemptions_per_replica_hour on_loss
    [embedded] settings for rehearsing the plan on this machine (see EmbeddedPlan)
"""

from __future__ import annotations

import copy
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import tomli_w
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.model import load_model_spec
from mixfleet.costmodel.paths import data_path
from mixfleet.costmodel.workload import load_workload
from mixfleet.policies import registry

LOSSES = ("grpo", "mis", "sc", "sc_mis")
ROUTING_MODES = ("free", "replay")   # MoE trainer: its own router | rollout routing replay (the samplers' experts)
ON_LOSS = ("resume", "restart")
COST_BACKENDS = ("roofline", "auto", "aiconfigurator")
DEFAULT_POLICIES = {"router": "capacity_proportional", "autoscaler": "fixed", "batcher": "fifo",
                    "weight_sync": "in_flight"}


def _need(where: str, name: str, ok: bool, value: Any, allowed: str) -> None:
    if not ok:
        raise SpecError(where, name, value, allowed)


def _pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """One sampler group: replicas of one (accelerator, precision) with one KV dtype."""
    name: str                        # unique within the plan, e.g. "H100-FP8"
    accelerator: str                 # a catalog name, e.g. "H100" (or "CPU-2core" for embedded runs)
    precision: str                   # weights: "bf16" | "fp8" | "nvfp4" | "mxfp4"
    kv_dtype: str = "fp8_e4m3"       # KV cache: "bf16" | "fp8_e4m3"
    kernel: str = ""                 # embedded engine's compute dtype (e.g. "fp32"); "" = precision's own
    replicas: int = 1                # replicas at start
    min_replicas: int | None = None  # autoscaler floor (default: replicas)
    max_replicas: int | None = None  # autoscaler cap (default: replicas)
    tp: int = 0                      # GPUs per replica; 0 = the smallest that fits (cost model)
    emulated: bool = False           # allow a precision the accelerator lacks natively (runs slower)
    dp_attention: int = 1            # attention data-parallel groups over the tp GPUs (SGLang --dp-size)
    ep: int = 1                      # expert-parallel size (SGLang --ep-size); 1 = experts tensor-parallel

    def __post_init__(self) -> None:
        w = f"plan group '{self.name}'"
        _need(w, "name", isinstance(self.name, str) and bool(self.name), self.name, "a non-empty string")
        for f in ("accelerator", "precision", "kv_dtype"):
            _need(w, f, isinstance(getattr(self, f), str) and bool(getattr(self, f)), getattr(self, f), "a name")
        _need(w, "replicas", isinstance(self.replicas, int) and self.replicas >= 0, self.replicas, "an integer >= 0")
        _need(w, "tp", isinstance(self.tp, int) and self.tp >= 0, self.tp, "an integer >= 0 (0 = auto)")
        _need(w, "dp_attention", _pos_int(self.dp_attention), self.dp_attention, "an integer >= 1")
        _need(w, "ep", _pos_int(self.ep), self.ep, "an integer >= 1")
        if self.dp_attention > 1 or self.ep > 1:
            _need(w, "tp", self.tp > 0 and self.tp % self.dp_attention == 0 and self.tp % self.ep == 0, self.tp,
                  f"GPUs per replica divisible by dp_attention ({self.dp_attention}) and ep ({self.ep})")
        if self.min_replicas is None:
            object.__setattr__(self, "min_replicas", self.replicas)
        if self.max_replicas is None:
            object.__setattr__(self, "max_replicas", self.replicas)
        _need(w, "min_replicas", isinstance(self.min_replicas, int) and 0 <= self.min_replicas <= self.replicas,
              self.min_replicas, f"an integer in 0..replicas ({self.replicas})")
        _need(w, "max_replicas", isinstance(self.max_replicas, int) and self.max_replicas >= self.replicas,
              self.max_replicas, f"an integer >= replicas ({self.replicas})")

    @property
    def layout(self) -> Any:
        """The cost model's Layout for an explicit attention-DP / expert-parallel group, else None (plain TP,
        `tp` GPUs or the smallest that fits)."""
        if self.dp_attention == 1 and self.ep == 1:
            return None
        from mixfleet.costmodel.measured import Layout

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
        _need(w, "gpus", _pos_int(self.gpus), self.gpus, "an integer >= 1")
        _need(w, "routing", self.routing in ROUTING_MODES, self.routing, "one of " + ", ".join(ROUTING_MODES))
        _need(w, "loss", self.loss in LOSSES, self.loss, "one of " + ", ".join(LOSSES))
        _need(w, "top_p", isinstance(self.top_p, int | float) and 0 < self.top_p <= 1, self.top_p, "in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class PolicyRef:
    """A registered policy and its settings."""
    name: str
    settings: dict[str, Any] = field(default_factory=dict)

    def build(self, kind: str) -> Any:
        return registry.make(kind, self.name, self.settings)


@dataclass(frozen=True, kw_only=True)
class PoliciesPlan:
    router: PolicyRef = field(default_factory=lambda: PolicyRef(name=DEFAULT_POLICIES["router"]))
    autoscaler: PolicyRef = field(default_factory=lambda: PolicyRef(name=DEFAULT_POLICIES["autoscaler"]))
    batcher: PolicyRef = field(default_factory=lambda: PolicyRef(name=DEFAULT_POLICIES["batcher"]))
    weight_sync: PolicyRef = field(default_factory=lambda: PolicyRef(name=DEFAULT_POLICIES["weight_sync"]))

    def __post_init__(self) -> None:
        for kind in registry.KINDS:  # validate names and settings now, not when the run starts
            ref = getattr(self, kind)
            registry.make_config(kind, ref.name, ref.settings)


@dataclass(frozen=True, kw_only=True)
class FaultsPlan:
    """Fault injection (the twin): replica preemptions / crashes as a Poisson process per replica."""
    preemptions_per_replica_hour: float = 0.0
    on_loss: str = "resume"          # a lost session "resume"s on a new replica (re-prefills) or "restart"s

    def __post_init__(self) -> None:
        _need("plan faults", "preemptions_per_replica_hour",
              isinstance(self.preemptions_per_replica_hour, int | float) and self.preemptions_per_replica_hour >= 0,
              self.preemptions_per_replica_hour, ">= 0")
        _need("plan faults", "on_loss", self.on_loss in ON_LOSS, self.on_loss, "one of " + ", ".join(ON_LOSS))


@dataclass(frozen=True, kw_only=True)
class EmbeddedPlan:
    """Settings for rehearsing the plan on this machine with embedded samplers (read by the runner).
    Each group becomes min(replicas, max_replicas_per_group) embedded samplers in its precision,
    KV dtype and kernel; the policies are the plan's."""
    max_replicas_per_group: int = 1  # scale each group down to at most this many local samplers
    threads_per_replica: int = 1     # torch threads per embedded sampler
    max_turns: int = 8               # episode turn cap
    max_new_tokens: int = 64         # reply tokens per turn cap
    temperature: float = 1.0
    task: str = ""                   # the runner's task name ("" = its default)
    eval_every: int = 0              # updates between pass@k evaluations (0 = never)
    pass_k: int = 4
    extra: dict[str, Any] = field(default_factory=dict)  # free-form runner settings

    def __post_init__(self) -> None:
        for f in ("max_replicas_per_group", "threads_per_replica", "max_turns", "max_new_tokens", "pass_k"):
            _need("plan embedded", f, _pos_int(getattr(self, f)), getattr(self, f), "an integer >= 1")
        _need("plan embedded", "eval_every", isinstance(self.eval_every, int) and self.eval_every >= 0,
              self.eval_every, "an integer >= 0")
        _need("plan embedded", "temperature", isinstance(self.temperature, int | float) and self.temperature > 0,
              self.temperature, "> 0")


@dataclass(frozen=True, kw_only=True)
class Plan:
    name: str
    groups: tuple[GroupPlan, ...]
    description: str = ""
    seed: int = 0
    cost_backend: str = "roofline"   # step times: "roofline" | "auto" (measured where covered) | "aiconfigurator"
    model: str = "qwen3.6-35b-a3b"   # a shipped model name or a TOML path
    workload: str = "seed-agentic-coding"  # a shipped workload name or a TOML path
    price_table: str = ""            # "" = the catalog's default price table
    prices: dict[str, float] = field(default_factory=dict)  # accelerator -> USD per GPU-hour, over the table
    trainer: TrainerPlan = field(default_factory=TrainerPlan)
    policies: PoliciesPlan = field(default_factory=PoliciesPlan)
    faults: FaultsPlan = field(default_factory=FaultsPlan)
    embedded: EmbeddedPlan | None = None

    def __post_init__(self) -> None:
        w = f"plan '{self.name}'"
        _need(w, "cost_backend", self.cost_backend in COST_BACKENDS, self.cost_backend, ", ".join(COST_BACKENDS))
        _need(w, "groups", len(self.groups) > 0, list(self.groups), "at least one [[groups]] entry")
        seen = [g.name for g in self.groups]
        dup = sorted({n for n in seen if seen.count(n) > 1})
        _need(w, "groups.name", not dup, dup, "unique group names")
        _need(w, "groups.replicas", any(g.replicas > 0 for g in self.groups), 0, "at least one group with replicas")
        _need(w, "seed", isinstance(self.seed, int), self.seed, "an integer")
        _need(w, "prices", isinstance(self.prices, dict), self.prices, "a table ACCELERATOR = USD per GPU-hour")
        for acc, usd in self.prices.items():
            _need(w, f"prices.{acc}", isinstance(usd, int | float) and not isinstance(usd, bool) and 0 < usd < 1e9,
                  usd, "USD per GPU-hour, a number > 0")
        if self.trainer.routing == "replay":
            kind = load_model_spec(self.model).kind
            _need(w, "trainer.routing", kind == "moe", self.trainer.routing,
                  f"'free' for model '{self.model}' (kind = '{kind}': routing replay needs a MoE model)")

    def group(self, name: str) -> GroupPlan:
        for g in self.groups:
            if g.name == name:
                return g
        raise SpecError(f"plan '{self.name}'", "group", name, [g.name for g in self.groups])

    def build_policies(self, workload: Any = None) -> dict[str, Any]:
        """Fresh policy objects: {"router": ..., "autoscaler": ..., "batcher": ..., "weight_sync": ...}.
        Batcher settings the plan leaves out come from the workload (costmodel WorkloadSpec; default: the
        plan's own `workload`): prompts_per_update, samples_per_prompt, and inflight_prompts = 4 x
        prompts_per_update. Both worlds build their policies here, so a plan has one update shape."""
        if workload is None:
            workload = load_workload(self.workload)
        out = {kind: getattr(self.policies, kind).build(kind) for kind in registry.KINDS}
        ref = self.policies.batcher
        ppu = ref.settings.get("prompts_per_update", workload.prompts_per_update)
        settings = {"prompts_per_update": ppu, "samples_per_prompt": workload.samples_per_prompt,
                    "inflight_prompts": 4 * ppu, **ref.settings}
        out["batcher"] = registry.make("batcher", ref.name, settings)
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain TOML-ready dict (None values omitted)."""
        out: dict[str, Any] = {"name": self.name}
        for key in ("description", "seed", "model", "workload", "price_table"):
            out[key] = getattr(self, key)
        if self.cost_backend != "roofline":
            out["cost_backend"] = self.cost_backend
        if self.prices:
            out["prices"] = dict(self.prices)
        out["trainer"] = _plain(self.trainer)
        out["groups"] = [{k: v for k, v in _plain(g).items()  # min/max equal to replicas are the defaults
                          if not (k in ("min_replicas", "max_replicas") and v == g.replicas)
                          and not (k in ("dp_attention", "ep") and v == 1)} for g in self.groups]
        out["policies"] = {k: {"name": getattr(self.policies, k).name, **getattr(self.policies, k).settings}
                           for k in registry.KINDS}
        out["faults"] = _plain(self.faults)
        if self.embedded is not None:
            out["embedded"] = _plain(self.embedded)
        return _drop_none(out)


def _plain(obj: Any) -> dict[str, Any]:
    return {f.name: copy.deepcopy(getattr(obj, f.name)) for f in fields(obj)}


def _drop_none(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _drop_none(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_none(v) for v in x]
    return x


# ---- building from dicts ------------------------------------------------------------------------------
def _build(cls: type, raw: Any, where: str) -> Any:
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


def plan_from_dict(raw: dict[str, Any]) -> Plan:
    """Validate a plan table (after base merging) and build the Plan."""
    raw = dict(raw)
    raw.pop("base", None)
    where = f"plan '{raw.get('name', '?')}'"
    if "name" not in raw:
        raise SpecError("plan", "name", None, "a value (the field is required)")
    groups_raw = raw.pop("groups", [])
    if not isinstance(groups_raw, list):
        raise SpecError(where, "groups", groups_raw, "an array of tables ([[groups]])")
    groups = tuple(_build(GroupPlan, g, f"{where} groups[{i}]") for i, g in enumerate(groups_raw))
    pol_raw = raw.pop("policies", {})
    for kind in pol_raw:
        if kind not in registry.KINDS:
            raise SpecError(f"{where} policies", kind, pol_raw[kind], registry.KINDS)
    refs = {}
    for kind in registry.KINDS:
        table = dict(pol_raw.get(kind, {}))
        refs[kind] = PolicyRef(name=table.pop("name", DEFAULT_POLICIES[kind]), settings=table)
    sub = {"trainer": TrainerPlan, "faults": FaultsPlan, "embedded": EmbeddedPlan}
    kwargs = {k: _build(cls, raw.pop(k), f"{where} [{k}]") for k, cls in sub.items() if k in raw}
    known = [f.name for f in fields(Plan)]
    for key in raw:
        if key not in known:
            raise SpecError(where, key, raw[key], "a known field: " + ", ".join(known + ["base"]))
    return Plan(**raw, **kwargs, groups=groups, policies=PoliciesPlan(**refs))


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
            if key in ("router", "autoscaler", "batcher", "weight_sync") and value.get("name", out[key].get("name")) \
                    != out[key].get("name"):
                out[key] = copy.deepcopy(value)  # another policy: its settings start afresh
            else:
                out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def with_overrides(plan: Plan, overrides: dict[str, Any]) -> Plan:
    """A variant: dotted keys, `groups.<name>.<field>` for a group (e.g. {"policies.router.name": "cost_aware"})."""
    over: dict[str, Any] = {}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if parts[0] == "groups":
            if len(parts) != 3:
                raise SpecError("override", dotted, value, "groups.<group name>.<field>")
            plan.group(parts[1])  # names the known groups if it is not one
            over.setdefault("groups", []).append({"name": parts[1], parts[2]: value})
            continue
        node = over
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return plan_from_dict(merge(plan.to_dict(), over))


# ---- files ----------------------------------------------------------------------------------------------
def _resolve(ref: str, near: Path | None) -> Path:
    """A plan file: `ref` as a path or a shipped name. As a `base` (near = the folder of the plan naming it),
    only a shipped name or a .toml file inside that folder: an uploaded plan cannot make the server read (and
    echo in its errors) any other TOML file."""
    p = Path(ref)
    shipped = [data_path("plans", f"{ref}.toml"), data_path("fleets", f"{ref}.toml")] \
        if p.suffix != ".toml" and len(p.parts) == 1 else []
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
    """Shipped plan names (data/plans and data/fleets)."""
    return sorted({p.stem for d in ("plans", "fleets") for p in data_path(d).glob("*.toml")})


def load_plan_dict(path: str | Path, _depth: int = 0) -> dict[str, Any]:
    """The merged raw table of a plan file (its `base` chain resolved)."""
    path = _resolve(str(path), None) if not Path(path).is_file() else Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except UnicodeDecodeError:
        raise SpecError(str(path), "<file>", "binary data", "a UTF-8 TOML plan file") from None
    except tomllib.TOMLDecodeError as e:
        raise SpecError(str(path), "<file>", "not TOML", f"valid TOML ({e})") from None
    base = raw.get("base")
    if base is None:
        return raw
    if not isinstance(base, str):
        raise SpecError(str(path), "base", base, "a string: a shipped plan name or a .toml file beside this plan")
    if _depth > 8:
        raise SpecError(str(path), "base", base, "a base chain shorter than 8 (is it circular?)")
    return merge(load_plan_dict(_resolve(base, path.parent), _depth + 1), raw)


def load_plan(path: str | Path) -> Plan:
    """Load a plan by path or shipped name (e.g. "seed-mixed"), resolving `base` variants."""
    return plan_from_dict(load_plan_dict(path))


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write the plan as TOML (a complete file, no `base`)."""
    path = Path(path)
    path.write_text(tomli_w.dumps(plan.to_dict()))
    return path
