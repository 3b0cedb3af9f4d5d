"""A plan -> the plan its rehearsal on this machine runs (`mixfleet run PLAN --embedded`, the app's "Run for
real" with embedded samplers): the one transform, so the CLI and the app rehearse a plan the same way.

A rehearsal runs the plan's own fleet as embedded samplers on this machine. Kept as planned: every group (its
name, accelerator, weight precision, KV dtype, kernel, emulated kernel error), the trainer (loss, top-p and its
replay, MoE routing; priced as its accelerator), the policies (router, autoscaler, weight sync, the batcher's
staleness rules), the prices. What changes, and only where the plan cannot run here as written:

- the model: a model too large for this machine (> `CPU_MODEL_MAX_PARAMS`) is replaced by the tiny stand-in of
  its family (`STAND_INS`: dense -> `tiny`, MoE -> `tiny-qwen3-moe`, the models `mixfleet pretrain --model`
  trains a base policy for), and the workload by the stand-in's (`tiny-cpu`: 1K contexts);
- each group's layout: one replica is one embedded sampler (TP1, no attention DP or expert parallelism);
- replica counts: each group keeps `min(replicas, max_replicas_per_group)` samplers (runner/orchestration/
  fleet.py, which also keeps each group's planned share of the routing weight); a plan without an `[embedded]`
  table gets `max_replicas_per_group` from this machine's cores (at least one sampler per group);
- the batch of a GPU plan: at most tiny-cpu's 8 prompts x 8 samples, 12 in flight (`REHEARSAL_BATCH`).

A plan that is already a CPU plan of a CPU-sized model runs as written (`Rehearsal.changes` is empty). What
still cannot run here is a SpecError naming the plan field and why: a format the embedded engine lacks, more
samplers than this machine's memory holds (`SAMPLER_MEMORY_BYTES` each).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.costmodel.specs.model import load_model_spec
from mixfleet.policies.plan import EmbeddedPlan, Plan, plan_from_dict

STAND_INS = {"dense": "tiny", "moe": "tiny-qwen3-moe"}   # model kind -> its tiny stand-in (data/models)
STAND_IN_WORKLOAD = "tiny-cpu"                            # the stand-ins' workload (data/workloads: 1K contexts)
CPU_MODEL_MAX_PARAMS = 100_000_000    # a model up to this size is rehearsed as itself (tiny: 3.3M, tiny MoE: 7.2M)
REHEARSAL_BATCH = {"prompts_per_update": 8, "samples_per_prompt": 8, "inflight_prompts": 12}   # tiny-cpu's batch
# Resident memory of one embedded sampler (a Ray worker process with torch and a stand-in's engine): 0.28-0.30 GiB
# measured (ps RSS of the 8 samplers of the seed-mixed rehearsal on this project's 2-core machine, 2026-12-01),
# rounded up to 0.5 GiB; the trainer and Ray are counted as two more.
SAMPLER_MEMORY_BYTES = 1 << 29
CPU_KINDS = ("cpu",)


@dataclass(frozen=True, kw_only=True)
class Machine:
    """What this machine offers a rehearsal."""
    cores: int                        # CPU cores (os.cpu_count)
    memory_bytes: int                 # memory available now (MemAvailable)

    @classmethod
    def here(cls) -> Machine:
        return cls(cores=os.cpu_count() or 1, memory_bytes=_available_memory_bytes())

    @property
    def sampler_limit(self) -> int:
        """Embedded samplers this machine's memory holds beside the trainer and Ray."""
        return max(0, self.memory_bytes // SAMPLER_MEMORY_BYTES - 2)


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


@dataclass(frozen=True, kw_only=True)
class RehearsedGroup:
    """One group as rehearsed: what is kept and how many samplers stand in for its replicas."""
    name: str
    accelerator: str
    precision: str
    kv_dtype: str
    kernel: str                       # "" = the precision's own
    planned: int                      # the plan's replicas
    here: int                         # embedded samplers started here
    layout: str                       # the plan's layout, e.g. "TP4" or "TP8 DP8 EP8" ("auto": the smallest)


@dataclass(frozen=True, kw_only=True)
class Rehearsal:
    """A plan and the plan its rehearsal on this machine runs."""
    source: Plan                      # the plan as given
    plan: Plan                        # what runs here (the same plan when nothing had to change)
    groups: tuple[RehearsedGroup, ...]
    changes: tuple[str, ...]          # what changed and why, one sentence each (empty: runs as written)
    machine: Machine

    @property
    def model(self) -> str:
        return self.plan.model

    def lines(self) -> list[str]:
        """What the CLI prints and the app shows before a rehearsal starts."""
        if not self.changes:
            return [f"rehearsal of '{self.source.name}' as written ({sum(g.here for g in self.groups)} embedded "
                    "samplers)"]
        out = [f"rehearsal of '{self.source.name}' on this machine ({self.machine.cores} cores): " + "; ".join(
            self.changes)]
        for g in self.groups:
            kernel = f", kernel {g.kernel}" if g.kernel else ""
            out.append(f"  {g.name}: {g.precision} weights, KV {g.kv_dtype}{kernel}: {g.planned} planned "
                       f"{g.accelerator} replicas ({g.layout}) -> {g.here} embedded sampler{'s' * (g.here != 1)}")
        return out


def _layout(g: Any) -> str:
    if not g.tp:
        return "auto layout"
    parts = [f"TP{g.tp}"] + ([f"DP{g.dp_attention}"] if g.dp_attention > 1 else []) + ([f"EP{g.ep}"] if g.ep > 1
                                                                                          else [])
    return " ".join(parts)


def _all_cpu(plan: Plan) -> bool:
    cat = load_catalog(plan.price_table or None)
    kinds = {cat.accelerator(g.accelerator).kind for g in plan.groups}
    return kinds <= set(CPU_KINDS)


def rehearsal_of(plan: Plan, machine: Machine | None = None) -> Rehearsal:
    """The plan a rehearsal of `plan` runs on `machine` (default: this one); see the module doc. Raises a
    SpecError naming the field when the plan cannot be rehearsed here."""
    from mixfleet.runner.orchestration.fleet import ENGINE_KV_DTYPES, ENGINE_PRECISIONS, fleet_from_plan

    machine = machine or Machine.here()
    where = f"plan '{plan.name}'"
    for g in plan.groups:
        if g.precision not in ENGINE_PRECISIONS:
            raise SpecError(f"{where} group '{g.name}'", "precision", g.precision,
                            f"a precision the embedded engine runs here ({', '.join(ENGINE_PRECISIONS)})")
        if g.kv_dtype not in ENGINE_KV_DTYPES:
            raise SpecError(f"{where} group '{g.name}'", "kv_dtype", g.kv_dtype,
                            f"a KV dtype the embedded engine runs here ({', '.join(ENGINE_KV_DTYPES)})")
    raw = plan.to_dict()
    changes: list[str] = []
    spec = load_model_spec(plan.model)
    if spec.total_params > CPU_MODEL_MAX_PARAMS:
        stand_in = STAND_INS.get(spec.kind)
        if stand_in is None:
            raise SpecError(where, "model", plan.model, f"a model of a family with a tiny stand-in "
                            f"({', '.join(STAND_INS)}), or one of at most {CPU_MODEL_MAX_PARAMS / 1e6:.0f}M parameters")
        raw["model"], raw["workload"] = stand_in, STAND_IN_WORKLOAD
        changes.append(f"model {spec.name} ({spec.total_params / 1e9:.1f}B parameters, {spec.kind}) -> its tiny "
                       f"stand-in {stand_in}, workload {plan.workload} -> {STAND_IN_WORKLOAD}")
    gpu_plan = not _all_cpu(plan)
    if gpu_plan:
        for g in raw["groups"]:
            g.update(tp=0, dp_attention=1, ep=1)
        changes.append("one embedded sampler per replica (TP1)")
        batcher = raw.setdefault("policies", {}).setdefault("batcher", {})
        shape = plan.build_policies()["batcher"].config
        smaller = {k: min(int(getattr(shape, k)), v) for k, v in REHEARSAL_BATCH.items()}
        if any(smaller[k] != int(getattr(shape, k)) for k in smaller):
            changes.append(f"batch {shape.prompts_per_update} x {shape.samples_per_prompt} "
                           f"({shape.inflight_prompts} in flight) -> {smaller['prompts_per_update']} x "
                           f"{smaller['samples_per_prompt']} ({smaller['inflight_prompts']} in flight)")
        batcher.update(smaller)
        if plan.embedded is None:
            raw["embedded"] = {"max_replicas_per_group": max(1, machine.cores // max(1, len(plan.groups)))}
    layouts = {g.name: _layout(g) for g in plan.groups}
    if changes:
        raw["description"] = f"rehearsal on this machine of: {plan.description or plan.name}"
        rehearsed = plan_from_dict(raw)
    else:
        rehearsed = plan
    fleet = fleet_from_plan(rehearsed, mode="embedded")
    groups = tuple(RehearsedGroup(name=g.name, accelerator=g.accelerator, precision=g.precision, kv_dtype=g.kv_dtype,
                                  kernel=g.kernel, planned=g.replicas, here=fleet.group(g.name).replicas,
                                  layout=layouts[g.name]) for g in plan.groups)
    total, planned = sum(g.here for g in groups), sum(g.planned for g in groups)
    if total != planned:
        cap = (rehearsed.embedded or EmbeddedPlan()).max_replicas_per_group
        why = (f"this machine's {machine.cores} cores over {len(plan.groups)} groups" if plan.embedded is None
               else "the plan's [embedded] max_replicas_per_group")
        changes.append(f"{planned} replicas -> {total} embedded samplers (at most {cap} per group: {why})")
    if total > machine.sampler_limit:
        raise SpecError(where, "groups", f"{total} embedded samplers",
                        f"at most {machine.sampler_limit} on this machine ({machine.memory_bytes / 2**30:.1f} GiB "
                        f"available, about {SAMPLER_MEMORY_BYTES / 2**30:.1f} GiB per sampler): fewer groups, or "
                        "run it on a Ray cluster carrying its accelerators")
    return Rehearsal(source=plan, plan=rehearsed, groups=groups, changes=tuple(changes), machine=machine)
