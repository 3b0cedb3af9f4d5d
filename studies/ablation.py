"""The ablation driver: which loss corrections keep mixed-sampler RL stable (the seed's study, at small scale).

Six variants differ only in the loss (one place: `VARIANTS`); everything else is one base plan per fleet
(data/plans/ablation-mixed.toml, data/plans/ablation-homogeneous.toml), one base policy, one task and the same
seeds:

    GRPO            loss grpo,   full sampling
    GRPO+MIS        loss mis,    full sampling
    SC              loss sc,     full sampling
    GRPO+top-p      loss grpo,   top-p sampling + mask replay in the trainer
    SC+MIS          loss sc_mis, full sampling
    SC+MIS+top-p    loss sc_mis, top-p sampling + mask replay

Every (fleet, variant, seed) is one real run (`runner/orchestration/orchestrator.py`, the same loop as
`mixfleet run`) in its own child process (its own local Ray, killed with it), writing its run log to
`OUT/<fleet>/<variant>/seed<S>/`, plus `ablation_run.json` there (what the run is). `OUT/ablation.json` is the
manifest (config, base policy, variants' overrides, each run's status and wall time).

Resumable: a run whose log says "finished" at >= the target updates is skipped; an unfinished one (killed,
failed, or finished at fewer updates than now asked) is continued from its trainer checkpoint with
`resume=True` (the runner cuts its log back to that checkpoint), and refused without it (so nothing is
silently overwritten). Runs go one at a time by default (`parallel=1`: this 2-core machine); `parallel=K`
keeps K children going.

    from mixfleet.studies.ablation import AblationConfig, run_ablation
    run_ablation(AblationConfig(out_dir=Path("runs/ablation"), fleets=("mixed", "homogeneous"), seeds=(0, 1),
                                updates=20))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.policies.plan import Plan, load_plan, with_overrides
from mixfleet.studies.runs import StudyRun, StudySettings, run_states, run_study

ABLATION_FILE = "ablation.json"
RUN_FILE = "ablation_run.json"
DEFAULT_TOP_P = 0.95            # the top-p of the two top-p variants (the shipped tiny-cpu plan's)
FLEET_PLANS = {"mixed": "ablation-mixed", "homogeneous": "ablation-homogeneous", "mixed-moe": "ablation-mixed-moe",
               "mixed-moe-replay": "ablation-mixed-moe-replay"}
FLEET_CHOICES = ("mixed", "homogeneous", "both", "mixed-moe", "mixed-moe-replay", "moe")


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One loss variant: the only thing that differs between the runs of a fleet and seed."""

    key: str                     # folder name, e.g. "sc_mis_topp"
    label: str                   # the seed's name, e.g. "SC+MIS+top-p"
    loss: str                    # TrainerPlan.loss: grpo | mis | sc | sc_mis
    top_p: bool                  # top-p sampling with mask replay in the trainer

    def overrides(self, top_p: float = DEFAULT_TOP_P) -> dict[str, Any]:
        """The plan overrides (dotted keys, `policies.plan.with_overrides`) that make this variant."""
        return {"trainer.loss": self.loss, "trainer.top_p": top_p if self.top_p else 1.0,
                "trainer.top_p_replay": self.top_p}


VARIANTS: tuple[Variant, ...] = (
    Variant(key="grpo", label="GRPO", loss="grpo", top_p=False),
    Variant(key="grpo_mis", label="GRPO+MIS", loss="mis", top_p=False),
    Variant(key="sc", label="SC", loss="sc", top_p=False),
    Variant(key="grpo_topp", label="GRPO+top-p", loss="grpo", top_p=True),
    Variant(key="sc_mis", label="SC+MIS", loss="sc_mis", top_p=False),
    Variant(key="sc_mis_topp", label="SC+MIS+top-p", loss="sc_mis", top_p=True),
)
VARIANT_KEYS = tuple(v.key for v in VARIANTS)
LABELS = {v.key: v.label for v in VARIANTS}


def variant(key: str) -> Variant:
    """The variant named `key` (its folder name or its label, e.g. "sc_mis" or "SC+MIS")."""
    for v in VARIANTS:
        if key in (v.key, v.label):
            return v
    raise ValueError(f"ablation variant = {key!r}; allowed: {', '.join(VARIANT_KEYS)}")


def fleets_for(choice: str) -> tuple[str, ...]:
    """A fleet name, "both" (mixed + homogeneous) or "moe" (the mixed fleet on tiny-qwen3-moe, routing free and
    replayed) -> the fleets to run."""
    if choice not in FLEET_CHOICES:
        raise ValueError(f"ablation fleet = {choice!r}; allowed: {', '.join(FLEET_CHOICES)}")
    return {"both": ("mixed", "homogeneous"), "moe": ("mixed-moe", "mixed-moe-replay")}.get(choice, (choice,))


@dataclass(frozen=True, kw_only=True)
class AblationConfig:
    """What to run (validated on construction; errors name the field and the allowed values)."""

    out_dir: Path
    fleets: tuple[str, ...] = ("mixed", "homogeneous")
    variants: tuple[str, ...] = VARIANT_KEYS
    seeds: tuple[int, ...] = (0, 1)
    updates: int = 30                          # trainer updates per run
    resume: bool = False                       # continue unfinished runs (else they are refused)
    parallel: int = 1                          # child runs at once (1: this 2-core machine)
    base_policy: str = ""                      # HF checkpoint of the base policy; "": the cached `mixfleet pretrain`
    plans: dict[str, str] = field(default_factory=dict)   # fleet -> plan file/name (default FLEET_PLANS)
    top_p: float = DEFAULT_TOP_P
    lr: float | None = None                    # trainer learning rate (AdamW) for every run; None: the plans' own
    eval_every: int = 10                       # held-out evaluations every N updates (0: none)
    run_timeout_s: float = 3600.0              # a child still running after this is killed (status "timeout")
    start_gap_s: float = 30.0                  # seconds between two child starts (Ray start-ups overload a small host)
    retries: int = 2                           # a run that fails (e.g. workers killed by Ray's memory monitor on a
                                               # shared host) is continued from its checkpoint up to this many times

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))
        for name in ("fleets", "variants", "seeds"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for f in self.fleets:
            if f not in FLEET_PLANS:
                raise ValueError(f"ablation fleets: {f!r}; allowed: {', '.join(FLEET_PLANS)}")
        if not self.fleets or len(set(self.fleets)) != len(self.fleets):
            raise ValueError(f"ablation fleets = {self.fleets!r}; allowed: distinct names of {', '.join(FLEET_PLANS)}")
        object.__setattr__(self, "variants", tuple(variant(v).key for v in self.variants))
        if not self.variants or len(set(self.variants)) != len(self.variants):
            raise ValueError(f"ablation variants = {self.variants!r}; allowed: distinct names of "
                             f"{', '.join(VARIANT_KEYS)}")
        if not self.seeds or any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in self.seeds) \
                or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"ablation seeds = {self.seeds!r}; allowed: distinct integers >= 0")
        for name, lo in (("updates", 1), ("parallel", 1), ("eval_every", 0), ("retries", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"ablation {name} = {v!r}; allowed: an integer >= {lo}")
        for f in self.plans:
            if f not in FLEET_PLANS:
                raise ValueError(f"ablation plans: fleet {f!r}; allowed: {', '.join(FLEET_PLANS)}")
        if not (isinstance(self.top_p, int | float) and 0.0 < self.top_p < 1.0):
            raise ValueError(f"ablation top_p = {self.top_p!r}; allowed: a number in (0, 1)")
        if self.lr is not None and not (isinstance(self.lr, int | float) and 0.0 < self.lr < 1.0):
            raise ValueError(f"ablation lr = {self.lr!r}; allowed: a number in (0, 1)")
        if not self.run_timeout_s > 0:
            raise ValueError(f"ablation run_timeout_s = {self.run_timeout_s!r}; allowed: > 0")
        if not self.start_gap_s >= 0:
            raise ValueError(f"ablation start_gap_s = {self.start_gap_s!r}; allowed: >= 0")

    def plan_ref(self, fleet: str) -> str:
        return self.plans.get(fleet, FLEET_PLANS[fleet])


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One run of the study: (fleet, variant, seed) -> its folder and its complete plan."""

    fleet: str
    variant: str
    seed: int
    out_dir: Path

    @property
    def name(self) -> str:
        return f"{self.fleet}/{self.variant}/seed{self.seed}"


def run_specs(config: AblationConfig) -> list[RunSpec]:
    """Every run of the study, seeds outermost (so a partial study has whole seeds first), then fleet, variant."""
    return [RunSpec(fleet=f, variant=v, seed=s, out_dir=config.out_dir / f / v / f"seed{s}")
            for s in config.seeds for f in config.fleets for v in config.variants]


def variant_overrides(base_name: str, variant_key: str, seed: int, *, top_p: float = DEFAULT_TOP_P) -> dict[str, Any]:
    """The variant's loss overrides, the seed and the run's plan name: the one place the runs differ."""
    return {**variant(variant_key).overrides(top_p), "seed": int(seed), "name": f"{base_name}-{variant_key}-s{seed}"}


def variant_plan(base: Plan, variant_key: str, seed: int, *, top_p: float = DEFAULT_TOP_P) -> Plan:
    """The base plan with `variant_overrides` applied."""
    return with_overrides(base, variant_overrides(base.name, variant_key, seed, top_p=top_p))


def resolve_base_policy(config: AblationConfig, plan: Any) -> str:
    """The base policy checkpoint: the configured one, else the cached `mixfleet pretrain` of the plan's model,
    task and [embedded] base_steps (trained if missing), the base `mixfleet run` takes for the same plan."""
    if config.base_policy:
        if not (Path(config.base_policy) / "config.json").exists():
            raise ValueError(f"ablation base_policy = {config.base_policy!r}; allowed: a Hugging Face layout "
                             "checkpoint folder (config.json + safetensors)")
        return str(Path(config.base_policy).resolve())
    from mixfleet.runner.orchestration.pretrain import plan_base_config, pretrain

    return str(pretrain(plan_base_config(plan)).path)


def run_ablation(config: AblationConfig, *, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Run (or continue) the study; returns the manifest (also written to OUT/ablation.json). The runs go through
    the studies' one driver (studies/runs.py): child processes, resume, retries, time-outs."""
    plans = {f: load_plan(config.plan_ref(f)) for f in config.fleets}   # bad plans fail before anything starts
    specs = run_specs(config)
    runs = [StudyRun(name=s.name, out_dir=s.out_dir, plan=config.plan_ref(s.fleet),
                     overrides={**variant_overrides(plans[s.fleet].name, s.variant, s.seed, top_p=config.top_p),
                                "embedded.eval_every": config.eval_every,
                                "embedded.eval_at_start": bool(config.eval_every),
                                **({"embedded.lr": config.lr} if config.lr is not None else {})},
                     run={"updates": config.updates, "seed": int(s.seed)},
                     meta={"fleet": s.fleet, "variant": s.variant, "label": LABELS[s.variant], "seed": s.seed,
                           "updates": config.updates, "lr": config.lr},
                     run_file=RUN_FILE)
            for s in specs]
    # refused in the ablation's own words before any base policy is trained
    states = run_states(runs, resume=config.resume, where="ablation", folder=config.out_dir)
    bases = {f: resolve_base_policy(config, plans[f]) for f in config.fleets}    # cached: one training per base
    runs = [dataclasses.replace(r, base_policy=bases[s.fleet]) for r, s in zip(runs, specs, strict=True)]
    base_policy = bases[config.fleets[0]]
    extra = {"format": "mixfleet-ablation", "format_version": 1,
             "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
             "variants": {v.key: {"label": v.label, "overrides": v.overrides(config.top_p)}
                          for v in VARIANTS if v.key in config.variants},
             "plans": {f: config.plan_ref(f) for f in config.fleets}, "base_policies": bases}
    return run_study(runs, manifest_path=config.out_dir / ABLATION_FILE, manifest_extra=extra,
                     base_policy=base_policy, log=log, states=states,
                     settings=StudySettings(resume=config.resume, parallel=config.parallel,
                                            run_timeout_s=config.run_timeout_s, start_gap_s=config.start_gap_s,
                                            retries=config.retries))
