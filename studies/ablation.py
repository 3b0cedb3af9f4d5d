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

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.policies.plan import Plan, load_plan, with_overrides

ABLATION_FILE = "ablation.json"
RUN_FILE = "ablation_run.json"
DEFAULT_TOP_P = 0.95            # the top-p of the two top-p variants (the shipped tiny-cpu plan's)
FLEET_PLANS = {"mixed": "ablation-mixed", "homogeneous": "ablation-homogeneous"}
FLEET_CHOICES = ("mixed", "homogeneous", "both")


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
    """"mixed" | "homogeneous" | "both" -> the fleets to run."""
    if choice not in FLEET_CHOICES:
        raise ValueError(f"ablation fleet = {choice!r}; allowed: {', '.join(FLEET_CHOICES)}")
    return ("mixed", "homogeneous") if choice == "both" else (choice,)


@dataclass(frozen=True, kw_only=True)
class AblationConfig:
    """What to run (validated on construction; errors name the field and the allowed values)."""

    out_dir: Path
    fleets: tuple[str, ...] = ("mixed", "homogeneous")
    variants: tuple[str, ...] = VARIANT_KEYS
    seeds: tuple[int, ...] = (0, 1)
    updates: int = 20                          # trainer updates per run
    resume: bool = False                       # continue unfinished runs (else they are refused)
    parallel: int = 1                          # child runs at once (1: this 2-core machine)
    base_policy: str = ""                      # HF checkpoint of the base policy; "": the cached `mixfleet pretrain`
    plans: dict[str, str] = field(default_factory=dict)   # fleet -> plan file/name (default FLEET_PLANS)
    top_p: float = DEFAULT_TOP_P
    lr: float = 1e-4                           # trainer learning rate (AdamW), the same for every run
    eval_every: int = 0                        # pass@k evaluations (0: none; they cost a CPU run dearly)
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
        if not (isinstance(self.lr, int | float) and 0.0 < self.lr < 1.0):
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


def variant_plan(base: Plan, variant_key: str, seed: int, *, top_p: float = DEFAULT_TOP_P) -> Plan:
    """The base plan with the variant's loss overrides and the seed: the one place the runs differ."""
    over = variant(variant_key).overrides(top_p)
    over["seed"] = int(seed)
    over["name"] = f"{base.name}-{variant_key}-s{seed}"
    return with_overrides(base, over)


def run_state(spec: RunSpec, updates: int) -> str:
    """"new" (no log), "finished" (log finished at >= updates), "partial" (anything else with a log)."""
    run_json = spec.out_dir / "run.json"
    if not run_json.exists():
        return "new"
    try:
        from mixfleet.costmodel.runlog import RunLog

        log = RunLog.open(spec.out_dir)
        done = int(log.updates["version"].max()) if len(log.updates) else 0
        status = str(log.header.get("status", ""))
    except Exception:  # noqa: BLE001 - an unreadable log is unfinished
        return "partial"
    return "finished" if status == "finished" and done >= updates else "partial"


def resolve_base_policy(config: AblationConfig) -> str:
    """The base policy checkpoint: the configured one, else the cached `mixfleet pretrain` (trained if missing)."""
    if config.base_policy:
        if not (Path(config.base_policy) / "config.json").exists():
            raise ValueError(f"ablation base_policy = {config.base_policy!r}; allowed: a Hugging Face layout "
                             "checkpoint folder (config.json + safetensors)")
        return str(Path(config.base_policy).resolve())
    from mixfleet.runner.orchestration.pretrain import pretrain

    return str(pretrain().path)


def _child_argv(spec: RunSpec, config: AblationConfig, base_policy: str, resume: bool) -> list[str]:
    job = {"fleet": spec.fleet, "variant": spec.variant, "seed": spec.seed, "out_dir": str(spec.out_dir),
           "plan": config.plan_ref(spec.fleet), "updates": config.updates, "base_policy": base_policy,
           "resume": resume, "top_p": config.top_p, "lr": config.lr, "eval_every": config.eval_every}
    return [sys.executable, "-m", "mixfleet.studies.ablation", "--child", json.dumps(job)]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def run_ablation(config: AblationConfig, *, log: Callable[[str], Any] = print) -> dict[str, Any]:
    """Run (or continue) the study; returns the manifest (also written to OUT/ablation.json)."""
    specs = run_specs(config)
    states = {s.name: run_state(s, config.updates) for s in specs}
    partial = [s.name for s in specs if states[s.name] == "partial"]
    if partial and not config.resume:
        raise ValueError(f"ablation: unfinished runs under {config.out_dir}: {', '.join(partial)}; allowed: "
                         "pass resume (--resume) to continue them, or remove their folders")
    for f in config.fleets:                                    # bad plans fail before anything starts
        load_plan(config.plan_ref(f))
    base_policy = resolve_base_policy(config)
    config.out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = config.out_dir / ABLATION_FILE
    old = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest: dict[str, Any] = {
        "format": "mixfleet-ablation", "format_version": 1,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "base_policy": base_policy, "variants": {v.key: {"label": v.label, "overrides": v.overrides(config.top_p)}
                                                 for v in VARIANTS if v.key in config.variants},
        "plans": {f: config.plan_ref(f) for f in config.fleets},
        "runs": old.get("runs", {}), "started_unix_s": old.get("started_unix_s", time.time())}
    for s in specs:
        manifest["runs"].setdefault(s.name, {})["state"] = states[s.name]
    _write_json(manifest_path, manifest)
    todo = [s for s in specs if states[s.name] != "finished"]
    log(f"ablation: {len(specs)} runs, {len(specs) - len(todo)} finished, {len(todo)} to run "
        f"(parallel {config.parallel}), base policy {base_policy}")
    running: list[tuple[RunSpec, subprocess.Popen, float, Any]] = []
    queue = list(todo)
    attempts = {s.name: 0 for s in specs}
    last_start = -float("inf")
    while queue or running:
        while queue and len(running) < config.parallel and time.monotonic() - last_start >= config.start_gap_s:
            last_start = time.monotonic()
            s = queue.pop(0)
            s.out_dir.mkdir(parents=True, exist_ok=True)
            attempts[s.name] += 1
            resume = states[s.name] == "partial"
            fh = open(s.out_dir / "driver.log", "a")  # noqa: SIM115 - closed when the child ends
            child = subprocess.Popen(_child_argv(s, config, base_policy, resume), stdout=fh, stderr=subprocess.STDOUT,
                                     start_new_session=True)
            running.append((s, child, time.monotonic(), fh))
            manifest["runs"][s.name].update(state="running", resumed=resume, pid=child.pid)
            _write_json(manifest_path, manifest)
            log(f"  start {s.name}{' (resume)' if resume else ''}")
        time.sleep(0.5)
        for item in list(running):
            s, child, t0, fh = item
            rc = child.poll()
            timed_out = rc is None and time.monotonic() - t0 > config.run_timeout_s
            if timed_out:
                _kill_group(child)
                rc = child.wait()
            if rc is None:
                continue
            fh.close()
            running.remove(item)
            state = run_state(s, config.updates)
            status = "timeout" if timed_out else state if rc == 0 else f"failed (exit {rc})"
            wall = time.monotonic() - t0
            entry = manifest["runs"][s.name]
            entry.update(state=state, status=status, wall_s=entry.get("wall_s", 0.0) + wall, exit_code=rc)
            entry.pop("pid", None)
            _write_json(manifest_path, manifest)
            log(f"  done  {s.name}: {status} in {wall:.0f} s")
            if state != "finished" and not timed_out and attempts[s.name] <= config.retries:
                states[s.name] = "partial" if state == "partial" else "new"
                queue.append(s)                                # continue it from its checkpoint, at the end
                log(f"  retry {s.name} later (attempt {attempts[s.name] + 1} of {config.retries + 1})")
    manifest["finished_unix_s"] = time.time()
    _write_json(manifest_path, manifest)
    return manifest


def _kill_group(child: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    """One run, in this process (the driver's child): the variant's plan through the real runner."""
    import torch
    from mixfleet.runner.orchestration.orchestrator import RunConfig, run_plan

    torch.set_num_threads(1)
    out = Path(job["out_dir"])
    if not job["resume"]:
        for name in ("run.json", "trajectories", "updates", "groups", "events", "trainer_state", "weights"):
            p = out / name
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    plan = variant_plan(load_plan(job["plan"]), job["variant"], int(job["seed"]), top_p=float(job["top_p"]))
    _write_json(out / RUN_FILE, {"fleet": job["fleet"], "variant": job["variant"], "label": LABELS[job["variant"]],
                                 "seed": job["seed"], "plan_ref": job["plan"], "updates": job["updates"],
                                 "base_policy": job["base_policy"], "lr": job["lr"],
                                 "overrides": variant(job["variant"]).overrides(float(job["top_p"]))})
    cfg = RunConfig(out_dir=out, updates=int(job["updates"]), init_checkpoint=job["base_policy"],
                    resume=bool(job["resume"]), seed=int(job["seed"]), lr=float(job["lr"]),
                    eval_every=int(job["eval_every"]), eval_at_start=bool(job["eval_every"]), trainer_threads=1,
                    sampler_threads=1, ray_num_cpus=2)

    _start_ray(plan)

    def on_update(view: Any, _orch: Any) -> None:
        print(f"update {view.version}/{view.target} reward {view.reward_mean:.3f} k3 {view.kl_k3:.2e} "
              f"t {view.elapsed_s:.0f}s", flush=True)

    result = run_plan(plan, cfg, on_update=on_update)
    # the run's checkpoints are only needed to resume it; keep the log, drop the weights (disk)
    shutil.rmtree(out / "weights", ignore_errors=True)
    return result


RAY_START_ATTEMPTS = 4


def _start_ray(plan: Plan) -> None:
    """Start the child's local Ray as the runner would (same resources), retrying: on a loaded host Ray's own
    30 s start-up wait can run out. The runner's `init_ray` then finds it started."""
    import ray
    from mixfleet.runner.orchestration.actors import init_ray
    from mixfleet.runner.orchestration.fleet import fleet_from_plan

    resources = dict(fleet_from_plan(plan, mode="embedded").resources)
    for attempt in range(RAY_START_ATTEMPTS):
        try:
            init_ray(num_cpus=2, resources=resources)
            return
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception on a start-up timeout
            print(f"ray start attempt {attempt + 1} failed: {e}", flush=True)
            with contextlib.suppress(Exception):
                ray.shutdown()
            if attempt == RAY_START_ATTEMPTS - 1:
                raise
            time.sleep(10.0 * (attempt + 1))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m mixfleet.studies.ablation --child JOB_JSON` (what `run_ablation` starts per run)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "--child":
        print("usage: python -m mixfleet.studies.ablation --child JOB_JSON (use `mixfleet experiment ablation`)",
              file=sys.stderr)
        return 2
    result = run_child(json.loads(args[1]))
    print(json.dumps({"result": result}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
