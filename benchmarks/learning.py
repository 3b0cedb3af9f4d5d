"""The learning ladder: does RL improve the policy, rung by rung from the plainest loop to the mixed fleet?

    python benchmarks/learning.py [--rungs a0,a,b,c] [--seeds 0,1,2] [--updates 30] [--out runs/learning] [--resume]
    python benchmarks/learning.py --report-only --out runs/learning       # re-read the logs, write the results
    python benchmarks/learning.py --final-eval --rungs d-b300-c,d-c300 --versus d-c300:d-b300-c   # final policies,
                                                                          # 512 x 2 held-out episodes each
    python benchmarks/learning.py --study dense --list           # the study of issue 41: its runs, est. CPU, state
    python benchmarks/learning.py --study dense --resume [--max-runs N]   # run (continue) the next of them
    python benchmarks/learning.py --study dense --final-eval [--final-split general]   # 512 x 2 re-evaluation
    python benchmarks/learning.py --study dense --report-only    # learning_study.json with the verdicts, the table

The study (studies/learning_study.py: its arms as data, the verdict rules fixed before its runs) is a set of rungs
here (keys s-..., m-...) with its own seeds, horizons and evaluation, run in its own order.

Rungs (docs/learning.md), each a real run with a reward curve and held-out evaluations:
    a0          synchronous on-policy GRPO in one process (runner/orchestration/onpolicy.py: engine + trainer, no Ray)
    a           the same through the real runner: `mixfleet run --mode sync`, one fp32 sampler group (fp32 kernel
                and KV, exactly the trainer's numbers), GRPO, plan learning-onpolicy
    a-lr        a at half the learning rate (1.5e-4 after the same warm-up)
    b           a, fully asynchronous (`--mode async`) with the plan's staleness bound (max_staleness 2)
    b-c         b with c's correction (SC + MIS + top-p 0.95 replay): the homogeneous fleet c is held against
    b-c-drain   b-c with weight sync "drain" (a running request never continues on new weights over old KV)
    c           the mixed CPU fleet of tiny-cpu (bf16 / fp8 + fp8 KV / nvfp4 + fp8 KV), SC + MIS + top-p 0.95 replay
    b-c-p, c-p  b-c and c with the held-out evaluation at their own top-p 0.95 (`eval_top_p`): the policy they train
    b-c-lr, c-lr  b-c and c at a-lr's learning rate (1.5e-4)
    b-lr        b at 1.5e-4 (async GRPO, one fp32 group); c-grpo-lr the same GRPO on c's mixed fleet (the seed's
                finding 2: does uncorrected GRPO collapse sooner on mixed samplers than on homogeneous ones?)
    t-grpo, t-c the treatment fleet: tiny-cpu with emulated kernel error on its fp8 / nvfp4 groups
                (TREATMENT_NOISE), so that the mixed fleet is measurably further from the trainer than b-lr's
                homogeneous one; t-grpo with plain GRPO, t-c with the plan's own SC + MIS + top-p
    d-a0        a0 on tiny-qwen3-moe from a 300-step base (150 steps leave it at greedy 0.46) at lr 1.5e-4
    d-a, d-c    a (plan learning-onpolicy-moe) and c (tiny-moe-cpu) on tiny-qwen3-moe with trainer routing free;
    d-c-replay  d-c with routing replay (tiny-moe-cpu-replay)
    d-c300      d-c from d-a0's 300-step base at lr 1.5e-4; d-c300-replay the same with routing replay;
                d-c300-grpo the same fleet with plain GRPO (finding 2 on the MoE)

Held-out evaluation (the runner's, runner/rollout/evaluation.py): `--eval-problems` problems of the task's eval
split (the same ones every time), `--eval-samples` episodes each, sampled at T = 1 over the full vocabulary (the -p
rungs: the top-p 0.95 nucleus; each run records its own) by a bf16 engine loading the exported version; its mean
reward is the "held-out reward at T = 1" below (pass@k comes with it). Every run is resumable: `--resume` continues
unfinished runs from their checkpoints (studies/runs.py), finished ones are skipped. Results:
benchmarks/results/learning.json (per run: curves, settings, seed, the command; per rung: start -> end with the
spread over seeds; runs of rungs or seeds a command did not read are kept from the file's earlier contents) and
docs/img/learning.png (or .html without kaleido).

The periodic evaluation (64 x 2 episodes) leaves a standard error of ~0.04 on each run's mean: as large as the
0.05 a rung comparison asks about. `--final-eval` evaluates each finished run's last policy (and each model's base
policy) again on `--final-problems` x `--final-samples` episodes (`mixfleet evaluate`, runner/orchestration/
evaluate_run.py: the run's own settings, the same problems and random draws for every policy), resumable
(an evaluation already in the file with the same settings is kept), into benchmarks/results/learning_final_eval.json
with per-rung mean, spread and standard error over seeds, the gain over the base, and each `--versus A:B` difference.
`--final-split general` does the same on the task's generalisation split (problems training never shows: guess's
held-out range 1..2N with targets above N, calc's operands above the training range; runner/rollout/tasks/base.py)
into *_general.json beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from mixfleet.costmodel.jsonsafe import json_safe
from mixfleet.studies.ablation import variant
from mixfleet.studies.learning_study import ARMS, STUDY, TREATMENT_NOISE, estimate_s, study_order, verdicts
from mixfleet.studies.learning_study import markdown as study_markdown

# the loss variants as plan overrides, from the ablation's one table of them (studies/ablation.py)
SC_MIS_TOPP = variant("sc_mis_topp").overrides()   # SC + MIS, top-p 0.95 sampling with mask replay
GRPO = variant("grpo").overrides()                 # plain GRPO over the full vocabulary

# The rate the shipped plans carried until 2026-12-05 (now 1.5e-4, the rate the asynchronous fleets learn at):
# the rungs measured at it pin it, so that they run as they ran whatever the plans carry
RECIPE_LR_3E4 = {"lr": 3e-4}

RESULTS = Path(__file__).resolve().parent / "results" / "learning.json"
FINAL_RESULTS = Path(__file__).resolve().parent / "results" / "learning_final_eval.json"
STUDY_RESULTS = Path(__file__).resolve().parent / "results" / "learning_study.json"
STUDY_FINAL_RESULTS = Path(__file__).resolve().parent / "results" / "learning_study_final_eval.json"
FIGURES = Path(__file__).resolve().parents[1] / "docs" / "img"
INPROCESS_FILE = "onpolicy_result.json"
GROUP_SERIES = ("kl_k3", "extreme_share", "masked_share")     # per-group series read_run keeps (groups table)


@dataclass(frozen=True, kw_only=True)
class Rung:
    key: str
    label: str
    plan: str = ""                                   # "" = the in-process loop (a0)
    model: str = "tiny"
    mode: str = "async"
    overrides: dict[str, Any] = field(default_factory=dict)      # dotted plan keys
    settings: dict[str, Any] = field(default_factory=dict)       # run settings (e.g. lr): embedded.* overrides
                                                                 # (in process: OnPolicyConfig fields)
    pretrain_steps: int = 150                        # the base policy's pretraining (`mixfleet pretrain --steps`)

    @property
    def inprocess(self) -> bool:
        return not self.plan


RUNGS: dict[str, Rung] = {r.key: r for r in (
    Rung(key="a0", label="on-policy GRPO, in process (no Ray)"),
    Rung(key="a", label="on-policy GRPO, runner, sync, one fp32 group", plan="learning-onpolicy", mode="sync",
         settings=RECIPE_LR_3E4),
    Rung(key="a-lr", label="a at half the learning rate (1.5e-4)", plan="learning-onpolicy", mode="sync",
         settings={"lr": 1.5e-4}),
    Rung(key="b", label="GRPO, runner, async (staleness <= 2), one fp32 group", plan="learning-onpolicy",
         settings=RECIPE_LR_3E4),
    Rung(key="b-c", label="SC+MIS+top-p, runner, async, one fp32 group", plan="learning-onpolicy",
         overrides=SC_MIS_TOPP, settings=RECIPE_LR_3E4),
    Rung(key="b-c-drain", label="b-c with weight sync drain (no in-flight update)", plan="learning-onpolicy",
         overrides={**SC_MIS_TOPP, "policies.weight_sync.name": "drain"}, settings=RECIPE_LR_3E4),
    Rung(key="c", label="SC+MIS+top-p, runner, async, mixed fleet (bf16 / fp8 / nvfp4)", plan="tiny-cpu",
         settings=RECIPE_LR_3E4),
    Rung(key="b-c-p", label="b-c evaluated at its own top-p 0.95 (the nucleus policy it trains)",
         plan="learning-onpolicy", overrides=SC_MIS_TOPP, settings={**RECIPE_LR_3E4, "eval_top_p": 0.95}),
    Rung(key="c-p", label="c evaluated at its own top-p 0.95", plan="tiny-cpu",
         settings={**RECIPE_LR_3E4, "eval_top_p": 0.95}),
    Rung(key="b-c-lr", label="b-c at a-lr's learning rate (1.5e-4)", plan="learning-onpolicy",
         overrides=SC_MIS_TOPP,
         settings={"lr": 1.5e-4}),
    Rung(key="c-lr", label="c at a-lr's learning rate (1.5e-4)", plan="tiny-cpu", settings={"lr": 1.5e-4}),
    Rung(key="b-lr", label="b at a-lr's learning rate (1.5e-4): async GRPO, one fp32 group",
         plan="learning-onpolicy", settings={"lr": 1.5e-4}),
    Rung(key="c-grpo-lr", label="c-lr without correction: async GRPO on the mixed fleet (bf16 / fp8 / nvfp4)",
         plan="tiny-cpu", overrides=GRPO,
         settings={"lr": 1.5e-4}),
    Rung(key="t-grpo", label="GRPO, async, the treatment fleet (tiny-cpu with kernel noise fp8 0.5 / nvfp4 0.9)",
         plan="tiny-cpu", overrides={**GRPO, **TREATMENT_NOISE}),
    Rung(key="t-c", label="SC+MIS+top-p, async, the treatment fleet (tiny-cpu with kernel noise fp8 0.5 / nvfp4 0.9)",
         plan="tiny-cpu", overrides=TREATMENT_NOISE),
    Rung(key="d-a", label="MoE: on-policy GRPO, sync, one fp32 group, routing free",
         plan="learning-onpolicy-moe", model="tiny-qwen3-moe", mode="sync", settings=RECIPE_LR_3E4),
    Rung(key="d-a0", label="MoE: on-policy GRPO in process, 300-step base, lr 1.5e-4", model="tiny-qwen3-moe",
         pretrain_steps=300, settings={"lr": 1.5e-4}),
    Rung(key="d-c", label="MoE: SC+MIS+top-p, async, mixed fleet, routing free", plan="tiny-moe-cpu",
         model="tiny-qwen3-moe", settings=RECIPE_LR_3E4),
    Rung(key="d-c-replay", label="MoE: SC+MIS+top-p, async, mixed fleet, routing replay",
         plan="tiny-moe-cpu-replay", model="tiny-qwen3-moe", settings=RECIPE_LR_3E4),
    Rung(key="d-c300", label="MoE: d-c from the 300-step base at lr 1.5e-4 (d-a0's settings), routing free",
         plan="tiny-moe-cpu", model="tiny-qwen3-moe", pretrain_steps=300, settings={"lr": 1.5e-4}),
    Rung(key="d-c300-replay", label="MoE: d-c300 with routing replay", plan="tiny-moe-cpu-replay",
         model="tiny-qwen3-moe", pretrain_steps=300, settings={"lr": 1.5e-4}),
    Rung(key="d-c300-grpo", label="MoE: d-c300 without correction: async GRPO on the mixed fleet, routing free",
         plan="tiny-moe-cpu", model="tiny-qwen3-moe", pretrain_steps=300,
         overrides=GRPO,
         settings={"lr": 1.5e-4}),
    Rung(key="d-a300", label="MoE: on-policy GRPO, runner, sync, one fp32 group, 300-step base, lr 1.5e-4",
         plan="learning-onpolicy-moe", model="tiny-qwen3-moe", mode="sync", pretrain_steps=300,
         settings={"lr": 1.5e-4}),
    Rung(key="d-b300", label="MoE: GRPO, runner, async (staleness <= 2), one fp32 group, 300-step base, lr 1.5e-4",
         plan="learning-onpolicy-moe", model="tiny-qwen3-moe", pretrain_steps=300, settings={"lr": 1.5e-4}),
    Rung(key="d-b300-c", label="MoE: SC+MIS+top-p, runner, async, one fp32 group, 300-step base, lr 1.5e-4",
         plan="learning-onpolicy-moe", model="tiny-qwen3-moe", pretrain_steps=300,
         overrides=SC_MIS_TOPP,
         settings={"lr": 1.5e-4}),
)}

# The study of issue 41 (studies/learning_study.py STUDY): each arm is a rung under its own key, never one of the
# ladder's (earlier results are kept by (rung, seed))
_clash = sorted(set(ARMS) & set(RUNGS))
if _clash:
    raise RuntimeError(f"study arms {_clash} reuse ladder rung keys; allowed: keys not in RUNGS")
RUNGS.update({a.key: Rung(key=a.key, label=a.label, plan=a.plan, model=a.model, overrides=a.overrides,
                          settings=a.settings, pretrain_steps=a.pretrain_steps) for a in ARMS.values()})


KEPT_BASES = Path(__file__).resolve().parents[1] / "data" / "bases"


def base_policy(model: str, steps: int) -> str:
    """The base of (model, steps): the one kept in the repository (data/bases/<cache key>/, the study's: its
    pretraining is not bit-reproducible across machines, `study_base`, and a study outlives a machine), else the
    cached `mixfleet pretrain` base (built once per model and step count; later calls reuse it)."""
    from mixfleet.runner.orchestration.pretrain import PretrainConfig, pretrain

    return found_base(model, steps) or str(pretrain(PretrainConfig(model=model, steps=steps)).path)


def found_base(model: str, steps: int) -> str | None:
    """`base_policy`'s folder if it exists already (kept, or in the cache), without training one; else None."""
    from mixfleet.runner.orchestration.pretrain import PretrainConfig, cache_key, default_cache_dir

    key = cache_key(PretrainConfig(model=model, steps=steps))
    for folder in (KEPT_BASES / key, default_cache_dir() / key):
        if (folder / "model.safetensors").is_file():
            return str(folder)
    return None


def weights_digest(checkpoint: str) -> str | None:
    """sha256 (24 hex) of a checkpoint folder's weight files, so that runs from the same base say so; None if it
    is gone (a run read on another machine than the one it ran on)."""
    import hashlib

    folder = Path(checkpoint) if checkpoint else None
    files = sorted(folder.glob("*.safetensors")) if folder and folder.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        with f.open("rb") as fh:
            for chunk in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:24]


def run_inprocess(key: str, out: Path, seeds: list[int], args: argparse.Namespace, log: Any) -> None:
    """An in-process rung (a0, d-a0): runner/orchestration/onpolicy.py, one seed after another; a seed whose
    result file holds >= --updates updates is skipped (an unfinished one starts again: no checkpoints here)."""
    from mixfleet.runner.orchestration.onpolicy import OnPolicyConfig, train_on_policy

    r = RUNGS[key]
    base = base_policy(r.model, r.pretrain_steps)
    for seed in seeds:
        folder = out / key / f"seed{seed}"
        done = folder / INPROCESS_FILE
        if done.exists() and json.loads(done.read_text())["config"]["updates"] >= args.updates:
            log(f"  {key}/seed{seed}: finished, skipped")
            continue
        cfg = OnPolicyConfig(updates=args.updates, seed=seed, eval_every=args.eval_every,
                             eval_problems=args.eval_problems, eval_samples=args.eval_samples, **r.settings)
        t0 = time.time()

        def progress(kind: str, rec: dict[str, Any], seed: int = seed, t0: float = t0) -> None:
            if kind == "eval":
                log(f"  {key}/seed{seed}: eval v{rec['version']} held-out reward {rec['reward']:.3f}")
            elif rec["version"] % 5 == 0:
                log(f"  {key}/seed{seed}: update {rec['version']} reward {rec['reward']:.3f} "
                    f"({time.time() - t0:.0f} s)")

        res = train_on_policy(base, cfg, out_dir=folder / "exports", progress=progress)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / INPROCESS_FILE).write_text(json.dumps(res.to_dict(), indent=1))


def study_run(key: str, seed: int, updates: int, eval_every: int, eval_problems: int, eval_samples: int,
              out: Path) -> Any:
    """One runner run of a rung (studies/runs.py StudyRun) in OUT/<rung>/seed<S>."""
    from mixfleet.studies.runs import StudyRun

    r = RUNGS[key]
    return StudyRun(
        name=f"{key}/seed{seed}", out_dir=out / key / f"seed{seed}", plan=r.plan,
        overrides={**r.overrides, "seed": seed, "embedded.eval_every": eval_every,
                   "embedded.eval_at_start": True, "embedded.eval_problems": eval_problems,
                   "embedded.pass_k": eval_samples,
                   **{f"embedded.{k}": v for k, v in r.settings.items()}},   # the plan's run settings
        run_file="learning_run.json", run={"updates": updates, "seed": seed, "mode": r.mode},
        meta={"rung": key, "label": r.label, "model": r.model, "seed": seed})


def study_runs(rungs: list[str], seeds: list[int], args: argparse.Namespace, out: Path) -> list[Any]:
    return [study_run(key, seed, args.updates, args.eval_every, args.eval_problems, args.eval_samples, out)
            for key in rungs for seed in seeds]


def _eval_curve(events: Any) -> list[dict[str, float]]:
    import pandas as pd
    from mixfleet.costmodel.records.trackers import eval_frame  # the one reader of the runner's eval events

    return [{"version": int(r.version), "reward": float(r.reward), "pass_at_k": float(r.pass_at_k), "k": int(r.k),
             "problems": int(r.problems), "top_p": 1.0 if pd.isna(r.top_p) else float(r.top_p)}
            for r in eval_frame(events).itertuples()]                 # top_p: None / NaN in logs before 2026-12-02


def read_run(folder: Path, rung: str, seed: int) -> dict[str, Any] | None:
    """One run's curves from its run log (or the in-process result file); None if it has not started."""
    if RUNGS[rung].inprocess:
        f = folder / INPROCESS_FILE
        if not f.exists():
            return None
        res = json.loads(f.read_text())
        return {"rung": rung, "seed": seed, "status": "finished", "updates": len(res["updates"]),
                "train_reward": [u["reward"] for u in res["updates"]],
                "no_tool_call_share": [u["no_tool_call_share"] for u in res["updates"]],
                "kl_k3": [u["k3"] for u in res["updates"]], "entropy": [u["entropy"] for u in res["updates"]],
                "grad_norm": [u.get("grad_norm", math.nan) for u in res["updates"]],
                "evals": res["evals"], "wall_s": res["wall_s"], "config": res["config"],
                "base_checkpoint": res["base_checkpoint"], "base_digest": weights_digest(res["base_checkpoint"]),
                "pretrain_steps": RUNGS[rung].pretrain_steps,
                "eval_top_p": float(res["config"].get("eval_top_p", 1.0))}
    if not (folder / "run.json").exists():
        return None
    from mixfleet.costmodel.records.runlog import RunLog, extreme_shares

    log = RunLog.open(folder)
    u = log.updates.sort_values("version")
    versions = [int(v) for v in u["version"]]
    tr = log.trajectories
    trained = tr[tr["trained_version"] >= 1] if len(tr) else tr
    by_update = trained.groupby("trained_version")
    ntc = by_update["finish_reason"].apply(lambda s: float((s == "no_tool_call_3x").mean()))
    turns, gen = by_update["turns"].mean(), by_update["generated_tokens"].mean()
    groups: dict[str, dict[str, list[float]]] = {m: {} for m in GROUP_SERIES}
    if len(log.groups):
        for name, rows in log.groups.groupby("group"):
            at = rows.drop_duplicates("version", keep="last").set_index("version")
            for m in GROUP_SERIES:      # one entry per update (NaN where the group had no row in that update)
                groups[m][str(name)] = [float(at[m].get(v, math.nan)) for v in versions]
    evals = _eval_curve(log.events)
    init = str(log.header.get("runner", {}).get("init_checkpoint") or "")

    def per_update(series: Any) -> list[float]:
        return [float(series.get(v, math.nan)) for v in versions]

    return {"rung": rung, "seed": seed, "status": log.header.get("status"), "updates": int(len(u)),
            "base_checkpoint": init, "base_digest": weights_digest(init),
            "train_reward": [float(x) for x in u["reward_mean"]],
            "no_tool_call_share": per_update(ntc),
            "kl_k3": [float(x) for x in u["kl_k3"]], "kl_k3_by_group": groups["kl_k3"],
            # what the seed's diagnosis rests on, per update (issue 41): the trainer's gradient norm and entropy,
            # the share of tokens the correction masked and of extreme ratios (outside [0.2, 5]), per group too,
            # and the episode length (assistant turns, generated tokens) of the batch trained on
            "grad_norm": [float(x) for x in u["grad_norm"]], "entropy": [float(x) for x in u["entropy"]],
            "masked_share": [float(x) for x in u["masked_share"]],
            "extreme_share": [float(x) for x in extreme_shares(u)],
            "extreme_share_by_group": groups["extreme_share"], "masked_share_by_group": groups["masked_share"],
            "episode_turns": per_update(turns), "episode_generated_tokens": per_update(gen),
            "staleness_mean": [float(x) for x in u["staleness_mean"]], "evals": evals,
            "wall_s": float(u["end_s"].max()) if len(u) else math.nan, "plan": log.header.get("plan", {}).get("name"),
            "pretrain_steps": RUNGS[rung].pretrain_steps, "eval_top_p": evals[-1]["top_p"] if evals else 1.0}


def read_earlier(results: Path) -> dict[str, Any]:
    """The earlier results file ({} when there is none); an unreadable one stops the command (nothing is lost)."""
    if not results.exists():
        return {}
    try:
        return json.loads(results.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{results}: cannot read the earlier results to keep them ({e}); move it away first") from e


def merge_earlier(runs: list[dict[str, Any]], earlier: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """This command's runs plus the earlier results' runs of every (rung, seed) it did not read: a study spread
    over sessions (and over machines whose run folders are gone) keeps its rungs in one results file. An earlier
    run without its own command gets the earlier file's, one without its eval_top_p the only one there was then, 1."""
    have = {(r["rung"], r["seed"]) for r in runs}
    kept = [{**r, "command": r.get("command", earlier.get("command", "")),
             "eval_top_p": r.get("eval_top_p", 1.0)}                # runs before 2026-12-02 were all evaluated at 1
            for r in earlier.get("runs", [])
            if (r["rung"], r["seed"]) not in have and r["rung"] in RUNGS]
    order = list(RUNGS)
    return sorted(runs + kept, key=lambda r: (order.index(r["rung"]), r["seed"])), len(kept)


def finished_from(earlier: dict[str, Any], digest: str | None) -> frozenset[tuple[str, int]]:
    """(rung, seed) of the runs the earlier results record as finished from the base of weights `digest` (none
    without a digest): done, whether their folders are here or not."""
    return frozenset((r["rung"], r["seed"]) for r in earlier.get("runs", [])
                     if digest and r.get("status") == "finished" and r.get("base_digest") == digest)


def recorded_commands(earlier: dict[str, Any]) -> dict[tuple[str, int], str]:
    """(rung, seed) -> the command recorded with that run in the earlier results."""
    return {(r["rung"], r["seed"]): r["command"] for r in earlier.get("runs", []) if r.get("command")}


def _spread(values: list[float]) -> dict[str, float]:
    v = [x for x in values if math.isfinite(x)]
    if not v:
        return {"mean": math.nan, "min": math.nan, "max": math.nan, "sd": math.nan, "n": 0}
    return {"mean": statistics.fmean(v), "min": min(v), "max": max(v),
            "sd": statistics.stdev(v) if len(v) > 1 else 0.0, "n": len(v)}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_rung: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_rung.setdefault(r["rung"], []).append(r)
    out: dict[str, Any] = {}
    for key, all_rs in by_rung.items():
        rs = [r for r in all_rs if r["status"] == "finished"]     # a run still going (or killed) is shown, not averaged
        start = [r["evals"][0]["reward"] for r in rs if r["evals"] and r["evals"][0]["version"] == 0]
        end = [r["evals"][-1]["reward"] for r in rs if len(r["evals"]) > 1]
        first5 = [float(np.mean(r["train_reward"][:5])) for r in rs if len(r["train_reward"]) >= 10]
        last5 = [float(np.mean(r["train_reward"][-5:])) for r in rs if len(r["train_reward"]) >= 10]
        out[key] = {"label": RUNGS[key].label, "seeds": sorted(r["seed"] for r in rs),
                    "unfinished_seeds": sorted(r["seed"] for r in all_rs if r["status"] != "finished"),
                    "heldout_start": _spread(start), "heldout_end": _spread(end),
                    "heldout_gain": _spread([b - a for a, b in zip(start, end, strict=False)]),
                    "train_reward_first5": _spread(first5), "train_reward_last5": _spread(last5),
                    "end_version": [r["evals"][-1]["version"] for r in rs if r["evals"]]}
    for name, a, b in END_DIFFERENCES:
        if a in out and b in out:
            out[name] = out[a]["heldout_end"]["mean"] - out[b]["heldout_end"]["mean"]
    return out


# The rung comparisons the summary states (mean held-out end of A minus B): the issue's "c within 0.05 of b"
# at each learning rate, c against its homogeneous counterpart with the same loss, and the MoE's.
END_DIFFERENCES: tuple[tuple[str, str, str], ...] = (
    ("c_minus_b_end", "c", "b"), ("c_minus_b-c_end", "c", "b-c"), ("cp_minus_bcp_end", "c-p", "b-c-p"),
    ("c-lr_minus_b-lr_end", "c-lr", "b-lr"), ("c-lr_minus_b-c-lr_end", "c-lr", "b-c-lr"),
    ("dc_minus_da_end", "d-c", "d-a"), ("d-c300_minus_d-b300-c_end", "d-c300", "d-b300-c"),
    ("d-c300_minus_d-b300_end", "d-c300", "d-b300"),
)


def markdown_table(summary: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """The per-rung table of docs/learning.md: held-out start -> end per seed and as mean (min..max)."""
    lines = ["| rung | what | seeds | updates | held-out reward at T = 1, start -> end, per seed | mean start -> end "
             "(end min..max) | no-tool-call share, last update |", "|---|---|---|---|---|---|---|"]
    for key in RUNGS:
        s = summary.get(key)
        if not isinstance(s, dict):
            continue
        rs = sorted((r for r in runs if r["rung"] == key), key=lambda r: r["seed"])
        per = ", ".join(f"{r['evals'][0]['reward']:.3f} -> {r['evals'][-1]['reward']:.3f}"
                        + ("" if r["status"] == "finished" else f" ({r['status']}, v{r['evals'][-1]['version']})")
                        for r in rs if r["evals"])
        ntc = ", ".join(f"{r['no_tool_call_share'][-1]:.0%}" for r in rs if r["no_tool_call_share"])
        a, b = s["heldout_start"], s["heldout_end"]
        ends = sorted({int(r["evals"][-1]["version"]) for r in rs if r["evals"]})
        lines.append(f"| {key} | {s['label']} | {', '.join(str(r['seed']) for r in rs)} | "
                     f"{', '.join(map(str, ends))} | {per} | "
                     f"{a['mean']:.3f} -> {b['mean']:.3f} ({b['min']:.3f}..{b['max']:.3f}) | {ntc} |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], out_dir: Path) -> str:
    """Training reward per update and held-out reward per evaluated version, mean over seeds with a min..max
    band; PNG through plotly + kaleido where they work, else HTML (studies/ablation_report.py's one saver)."""
    import plotly.graph_objects as go
    from mixfleet.studies.ablation_report import _png_ok, _save
    from plotly.colors import qualitative
    from plotly.subplots import make_subplots

    rungs = sorted({r["rung"] for r in runs}, key=list(RUNGS).index)
    models = sorted({RUNGS[k].model for k in rungs}, key=lambda m: (m != "tiny", m))   # one row per model
    fig = make_subplots(rows=len(models), cols=2, horizontal_spacing=0.08, vertical_spacing=0.12,
                        subplot_titles=[f"{m}: {t}" for m in models for t in (
                            "training reward per update (band: min..max over seeds)",
                            "held-out reward at T = 1 (bf16 engine)")])
    for row, model in enumerate(models, start=1):
        for key in (k for k in rungs if RUNGS[k].model == model):
            rs = [r for r in runs if r["rung"] == key]
            color = qualitative.Dark24[rungs.index(key) % len(qualitative.Dark24)]   # one colour per rung
            curves = [("train", [list(range(1, len(r["train_reward"]) + 1)) for r in rs],
                       [r["train_reward"] for r in rs], 1),
                      ("held-out", [[e["version"] for e in r["evals"]] for r in rs],
                       [[e["reward"] for e in r["evals"]] for r in rs], 2)]
            for what, xs_all, ys_all, col in curves:
                n = min((len(y) for y in ys_all), default=0)
                if n == 0:
                    continue
                xs = xs_all[0][:n]
                ys = np.array([y[:n] for y in ys_all], dtype=float)
                if len(rs) > 1:
                    fig.add_trace(go.Scatter(x=xs + xs[::-1], y=list(ys.max(0)) + list(ys.min(0))[::-1],
                                             fill="toself", line={"width": 0}, fillcolor=color, opacity=0.15,
                                             showlegend=False, hoverinfo="skip"), row=row, col=col)
                fig.add_trace(go.Scatter(x=xs, y=ys.mean(0), mode="lines+markers" if what == "held-out" else "lines",
                                         line={"color": color}, name=f"{key} ({len(rs)} seeds)", legendgroup=key,
                                         showlegend=what == "train"), row=row, col=col)
        fig.update_xaxes(title_text="update", row=row, col=1)
        fig.update_xaxes(title_text="trainer version", row=row, col=2)
        fig.update_yaxes(title_text="reward", row=row, col=1)
    fig.update_layout(template="plotly_white", margin={"l": 50, "r": 20, "t": 40, "b": 40})
    out_dir.mkdir(parents=True, exist_ok=True)
    return _save(fig, out_dir, "learning", _png_ok(), 1200, 400 * len(models) + 40)


def _write_json_atomically(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(json_safe(doc), indent=1) + "\n")
    tmp.replace(path)                              # a kill mid-write leaves the previous file whole


def _se(values: list[float]) -> float:
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def final_eval(rungs: list[str], seeds: list[int], args: argparse.Namespace, out: Path, log: Any) -> dict[str, Any]:
    """Each finished runner run's last policy and each model's base, evaluated on the larger held-out set (module
    doc); one evaluation at a time, the file rewritten after each, so a stopped call loses at most one."""
    from mixfleet.runner.orchestration.evaluate_run import evaluate_policy, paired_difference, run_eval_settings

    path = Path(args.final_results)
    doc = read_earlier(path) or {}
    evals: dict[str, Any] = doc.get("evaluations", {})
    want = {"problems": args.final_problems, "k": args.final_samples, "seed": args.final_seed,
            "split": args.final_split}           # evaluations recorded before the split existed were of "eval"
    todo: list[tuple[str, Path, dict[str, Any], dict[str, Any]]] = []    # (key, path, overrides, meta)
    bases: dict[tuple[str, int], dict[str, Any]] = {}
    for key in rungs:
        r = RUNGS[key]
        if r.inprocess:
            log(f"  {key}: an in-process rung keeps no checkpoint to evaluate again; skipped")
            continue
        for seed in seeds:
            folder = out / key / f"seed{seed}"
            run = read_run(folder, key, seed)
            if run is None or run["status"] != "finished":
                log(f"  {key}/seed{seed}: not finished ({'not started' if run is None else run['status']}); skipped")
                continue
            settings = run_eval_settings(folder)
            bases.setdefault((r.model, r.pretrain_steps), settings)
            todo.append((f"{key}/seed{seed}", folder, {}, {"rung": key, "seed": seed, "model": r.model,
                                                          "pretrain_steps": r.pretrain_steps,
                                                          "version": run["updates"]}))
    for (model, steps), settings in sorted(bases.items()):
        todo.insert(0, (f"base/{model}/{steps}", Path(base_policy(model, steps)),
                        dict(settings),
                        {"rung": "base", "seed": None, "model": model, "pretrain_steps": steps}))
    for key, folder, overrides, meta in todo:
        have = evals.get(key)
        if have and have.get("source") == str(folder) \
                and all(have["settings"].get(k, "eval" if k == "split" else None) == v for k, v in want.items()) \
                and (meta["rung"] == "base" or have.get("version") == meta["version"]):
            log(f"  {key}: evaluated before with these settings; kept")
            continue
        t0 = time.perf_counter()
        res = evaluate_policy(folder, problems=args.final_problems, k=args.final_samples, seed=args.final_seed,
                              **{**overrides, "split": args.final_split})
        evals[key] = {**meta, **res.to_dict(),                # the version is the one evaluated
                      "command": " ".join(["python", "benchmarks/learning.py", *sys.argv[1:]])}
        log(f"  {key}: v{res.version} held-out reward {res.reward:.3f} +- {res.reward_se:.3f} "
            f"({time.perf_counter() - t0:.0f} s)")
        _write_json_atomically(path, {"command": " ".join(["python", "benchmarks/learning.py", *sys.argv[1:]]),
                                      "settings": want, "evaluations": evals})
    summary: dict[str, Any] = {}
    for key in sorted({e["rung"] for e in evals.values()}, key=lambda k: (k != "base", k)):
        es = sorted((e for e in evals.values() if e["rung"] == key), key=lambda e: (e["model"], e["seed"] or 0))
        for model in sorted({e["model"] for e in es}):
            mine = [e for e in es if e["model"] == model]
            vals = [e["reward"] for e in mine]
            base = next((e for e in evals.values() if e["rung"] == "base" and e["model"] == model
                         and e["pretrain_steps"] == mine[0]["pretrain_steps"]), None)
            name = key if key != "base" else f"base/{model}/{mine[0]['pretrain_steps']}"
            summary[name] = {"model": model, "seeds": [e["seed"] for e in mine], **_spread(vals), "se": _se(vals),
                             "eval_se": [e["reward_se"] for e in mine],
                             "gain_over_base": (statistics.fmean(vals) - base["reward"]) if base else math.nan}
    pairs = []
    for pair in args.versus:
        a, b = pair
        ea = {e["seed"]: e for e in evals.values() if e["rung"] == a}
        eb = {e["seed"]: e for e in evals.values() if e["rung"] == b}
        if not ea or not eb:
            log(f"  --versus {a}:{b}: no evaluations of {a if not ea else b} yet")
            continue
        va, vb = [e["reward"] for e in ea.values()], [e["reward"] for e in eb.values()]
        diff = statistics.fmean(va) - statistics.fmean(vb)
        se = math.sqrt(_se(va) ** 2 + _se(vb) ** 2) if len(va) > 1 and len(vb) > 1 else math.nan
        same = sorted(set(ea) & set(eb))
        pairs.append({"a": a, "b": b, "difference": diff, "se": se, "seeds_a": sorted(ea), "seeds_b": sorted(eb),
                      "per_seed_paired": {str(s): paired_difference(ea[s], eb[s]) for s in same}})
    doc = {"command": " ".join(["python", "benchmarks/learning.py", *sys.argv[1:]]), "settings": want,
           "summary": summary, "versus": pairs, "evaluations": evals}
    _write_json_atomically(path, doc)
    for name, s in summary.items():
        log(f"{name:>16}: {s['mean']:.3f} (se {s['se']:.3f} over {s['n']} seeds; min..max {s['min']:.3f}.."
            f"{s['max']:.3f}; each +- ~{statistics.fmean(s['eval_se']):.3f})"
            + ("" if name.startswith("base") else f", {s['gain_over_base']:+.3f} over the base"))
    for p in pairs:
        log(f"{p['a']} - {p['b']}: {p['difference']:+.3f} (se {p['se']:.3f})")
    log(f"wrote {path}")
    return doc


def _pairs(text: str) -> list[tuple[str, str]]:
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        a, sep, b = item.partition(":")
        if not sep or a not in RUNGS or b not in RUNGS:
            raise argparse.ArgumentTypeError(f"--versus: {item!r}; allowed: A:B with A, B of {', '.join(RUNGS)}")
        out.append((a, b))
    return out


def study_listing(study: str, out: Path, ladder: dict[str, Any],
                  recorded: frozenset[tuple[str, int]] = frozenset()) -> tuple[list[str], float, float]:
    """The study's runs in the order they run, each with its estimated CPU wall (studies/learning_study.py
    estimate_s, from the measured runs of `ladder`) and its state in OUT, or "finished (in the results)" for a
    run of `recorded` (finished in the results file) whose folder is not here; and the estimated seconds done /
    left."""
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.studies.runs import run_state

    lines, done_s, left_s = [], 0.0, 0.0
    for i, (arm, seed) in enumerate(study_order(study), start=1):
        folder = out / arm.key / f"seed{seed}"
        state = run_state(folder, arm.updates)
        if state != "finished" and (arm.key, seed) in recorded:
            state = "finished (in the results)"
        est = estimate_s(arm, ladder)
        if state == "partial":
            try:
                log = RunLog.open(folder)
                at = int(log.updates["version"].max()) if len(log.updates) else 0
            except Exception:  # noqa: BLE001 - an unreadable log counts as not started
                at = 0
            state = f"partial ({at} of {arm.updates} updates)"
            done_s, left_s = done_s + est * at / arm.updates, left_s + est * (1 - at / arm.updates)
        elif state.startswith("finished"):
            done_s += est
        else:
            left_s += est
        lines.append(f"{i:>3}  {arm.key + '/seed' + str(seed):<32} {arm.updates:>3} updates  "
                     f"est {est / 60:5.1f} min  {state}")
    return lines, done_s, left_s


def study_base(study: str, base: str, earlier: dict[str, Any]) -> str:
    """The digest of `base`, the study's base policy built (or found in the cache) here, after checking it is the
    base of the runs the results already hold: every contrast of the study is between runs of one base. The tiny
    base's pretraining is bit-reproducible on one machine but not across machines (its cache key 027f70fc... gave
    weights 9937026f... where the study's first 16 runs ran; b964d7b8... twice on the AVX-512 machine that
    replaced it, and 8e0f0c96... there with ATEN_CPU_CAPABILITY=avx2), so a base rebuilt elsewhere is refused,
    naming both digests, rather than mixed in."""
    digest = weights_digest(base)
    theirs = sorted({r["base_digest"] for r in earlier.get("runs", []) if r.get("base_digest")})
    if digest is None or (theirs and theirs != [digest]):
        n = sum(1 for r in earlier.get("runs", []) if r.get("base_digest"))
        raise SystemExit(
            f"study {study}: the base policy here ({base}, weights digest {digest}) is not the base of the "
            f"{n} run(s) already in the results (digest {', '.join(theirs)}): runs from it would not be same-base "
            "contrasts with them. Put that base's folder in the cache under the same key (`mixfleet pretrain "
            "--json` names the key) or start the study over in another --results file and --out folder.")
    return digest


def run_learning_study(args: argparse.Namespace, out: Path, log: Any) -> int:
    """--study: list, run (resumable), re-evaluate or report the study of issue 41 (studies/learning_study.py)."""
    from mixfleet.studies.learning_study import MODELS, RULES, STUDY_EVAL

    arms = STUDY[args.study]
    model, steps = MODELS[args.study]
    if args.list:
        found = found_base(model, steps)         # the runs recorded from the base here (none if it is not built)
        digest = weights_digest(found) if found else None
        recorded = finished_from(read_earlier(Path(args.results)), digest)
        lines, done_s, left_s = study_listing(args.study, out, read_earlier(RESULTS), recorded)
        log(f"study {args.study}: {len(lines)} runs on {model} from one {steps}-step base, in this order "
            f"(estimate: the measured wall per update of like ladder rungs in {RESULTS.name} x updates + start-up; "
            f"state from {out}):")
        for line in lines:
            log(line)
        log(f"estimated CPU hours: {(done_s + left_s) / 3600:.1f} in all, {done_s / 3600:.1f} done, "
            f"{left_s / 3600:.1f} left (plus the 512 x 2 re-evaluation of each finished run)")
        return 0
    keys, seeds = [a.key for a in arms], sorted({s for a in arms for s in a.seeds})
    if args.final_eval:
        final_eval(keys, seeds, args, out, log)     # runs not finished (or not in the study) are skipped, named
        return 0
    order = study_order(args.study)
    if not args.report_only:
        from mixfleet.studies.runs import StudySettings, run_state, run_study

        base = base_policy(model, steps)
        earlier = read_earlier(Path(args.results))
        digest = study_base(args.study, base, earlier)
        # a run the results record as finished from this base is done, its folder gone or not (another machine)
        recorded = finished_from(earlier, digest)
        todo = [(a, s) for a, s in order
                if (a.key, s) not in recorded and run_state(out / a.key / f"seed{s}", a.updates) != "finished"]
        done = len(order) - len(todo)
        if args.arms:                       # only these arms (e.g. those a pending decision does not touch)
            unknown = sorted(set(args.arms) - {a.key for a in arms})
            if unknown:
                raise SystemExit(f"--arms: {', '.join(unknown)} not in study {args.study}; allowed: "
                                 f"{', '.join(a.key for a in arms)}")
            todo = [(a, s) for a, s in todo if a.key in args.arms]
        if args.max_runs is not None:       # a session's share: the next runs in the study's order
            todo = todo[:args.max_runs]
        log(f"study {args.study}: {done} of {len(order)} runs finished; running now: "
            f"{', '.join(f'{a.key}/seed{s}' for a, s in todo) or 'none'}")
        runs = [study_run(a.key, s, a.updates, STUDY_EVAL["every"], STUDY_EVAL["problems"], STUDY_EVAL["samples"],
                          out) for a, s in todo]
        run_study(runs, manifest_path=out / f"study-{args.study}.json",
                  manifest_extra={"format": "mixfleet-learning-study", "study": args.study, "model": model,
                                  "pretrain_steps": steps, "rules": RULES,
                                  "order": [f"{a.key}/seed{s}" for a, s in order]},
                  base_policy=base, log=log,
                  settings=StudySettings(resume=args.resume, start_gap_s=5.0, run_timeout_s=5400.0))
    write_study_results(args, order, out, log)
    if not args.report_only and args.final_eval_after:
        # at once, while the run folders are here: the study's first round lost its 16 folders with their machine,
        # and with them the 512 x 2 re-evaluation of its final policies; then the verdicts again, with it
        before = read_earlier(Path(args.final_results)).get("evaluations", {})
        doc = final_eval(keys, seeds, args, out, log)
        if doc and doc.get("evaluations") != before:
            write_study_results(args, order, out, log)
    return 0


def write_study_results(args: argparse.Namespace, order: list[tuple[Any, int]], out: Path, log: Any) -> None:
    """The study's results file: the runs read from OUT plus the earlier file's others, their summary and the
    verdicts (with the 512 x 2 re-evaluations in --final-results where there are some)."""
    from mixfleet.studies.learning_study import RULES, STUDY_EVAL

    runs = [r for a, s in order if (r := read_run(out / a.key / f"seed{s}", a.key, s)) is not None]
    command = " ".join(["python", "benchmarks/learning.py", *sys.argv[1:]])
    earlier = read_earlier(Path(args.results))
    made_by = recorded_commands(earlier) if args.report_only else {}
    for r in runs:
        r["command"] = made_by.get((r["rung"], r["seed"]), command)
    runs, kept = merge_earlier(runs, earlier)
    if kept:
        log(f"kept {kept} earlier run(s) of {args.results} that this command did not read")
    final = read_earlier(Path(args.final_results)).get("evaluations", {})
    v = verdicts(runs, args.study, final)
    results = {"generated_unix_s": time.time(), "command": command, "study": args.study,
               "evaluation": {"problems": STUDY_EVAL["problems"], "samples_per_problem": STUDY_EVAL["samples"],
                              "every": STUDY_EVAL["every"], "temperature": 1.0, "precision": "bf16", "split": "eval"},
               "rules": RULES, "summary": summarize(runs), "verdicts": v, "runs": runs}
    _write_json_atomically(Path(args.results), results)
    log(study_markdown(v))
    log(f"wrote {args.results}")


def final_results_path(given: str | None, study: bool, split: str) -> str:
    """Where a final evaluation goes: --final-results (or the default), and for the general split the file beside
    it named *_general.json, also from a given path: one file holds one split, so a general re-evaluation never
    replaces the eval split's figures (a session's general run once wrote into the eval file it was given)."""
    path = Path(given) if given else (STUDY_FINAL_RESULTS if study else FINAL_RESULTS)
    return str(path if split == "eval" else path.with_name(f"{path.stem}_general.json"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rungs", default="a0,a,b,c", help=f"comma-separated, of {', '.join(RUNGS)}")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-problems", type=int, default=64)
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--out", default="runs/learning")
    ap.add_argument("--resume", action="store_true", help="continue unfinished runs from their checkpoints")
    ap.add_argument("--report-only", action="store_true", help="only read the logs and write the results")
    ap.add_argument("--results", default=None, help=f"default {RESULTS.name} ({STUDY_RESULTS.name} with --study)")
    ap.add_argument("--final-eval", action="store_true", help="evaluate the finished runs' last policies again on "
                    "--final-problems x --final-samples held-out episodes (no training)")
    ap.add_argument("--final-problems", type=int, default=512)
    ap.add_argument("--final-samples", type=int, default=2)
    ap.add_argument("--final-seed", type=int, default=0)
    ap.add_argument("--final-split", choices=("eval", "general"), default="eval",
                    help="the task split of the re-evaluation: eval (the held-out seeds) or general (problems unlike "
                    "training's: guess's held-out range, calc's unseen operands); general writes *_general.json")
    ap.add_argument("--final-results", default=None,
                    help=f"default {FINAL_RESULTS.name} ({STUDY_FINAL_RESULTS.name} with --study); with "
                    "--final-split general the file beside it named <stem>_general.json")
    ap.add_argument("--versus", type=_pairs, default=[], help="A:B[,C:D]: rung differences to report")
    ap.add_argument("--study", choices=sorted(STUDY), help="the study of issue 41 (studies/learning_study.py): "
                    "its arms, seeds, updates and evaluation are its own (--rungs, --seeds, --updates, --eval-* "
                    "are ignored); with --resume, --report-only, --final-eval or --list")
    ap.add_argument("--no-final-eval", dest="final_eval_after", action="store_false",
                    help="with --study --resume: do not re-evaluate the finished runs (--final-problems x "
                         "--final-samples) right after running them (the default, while their folders are here)")
    ap.add_argument("--max-runs", type=int, default=None, help="with --study: run at most this many of its "
                    "unfinished runs, the next ones in its order (a session's share)")
    ap.add_argument("--arms", type=lambda t: [x for x in t.split(",") if x], default=[],
                    help="with --study --resume: run only these arms (comma-separated), in the study's order")
    ap.add_argument("--list", action="store_true", help="with --study: print its runs in order with their "
                    "estimated CPU time and their state in --out; runs nothing")
    args = ap.parse_args(argv)
    if args.list and not args.study:
        ap.error("--list: allowed only with --study")
    args.results = args.results or str(STUDY_RESULTS if args.study else RESULTS)
    args.final_results = final_results_path(args.final_results, bool(args.study), args.final_split)
    rungs = [s.strip() for s in args.rungs.split(",") if s.strip()]
    for key in rungs:
        if key not in RUNGS:
            ap.error(f"--rungs: {key!r}; allowed: {', '.join(RUNGS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds: {args.seeds!r}; allowed: comma-separated integers >= 0")
    out = Path(args.out)

    def log(msg: str) -> None:
        print(msg, flush=True)

    if args.study:
        return run_learning_study(args, out, log)
    if args.final_eval:
        final_eval(rungs, seeds, args, out, log)
        return 0
    if not args.report_only:
        for key in (k for k in rungs if RUNGS[k].inprocess):
            run_inprocess(key, out, seeds, args, log)
        real = [k for k in rungs if not RUNGS[k].inprocess]
        from mixfleet.studies.runs import StudySettings, run_study

        for model, steps in sorted({(RUNGS[k].model, RUNGS[k].pretrain_steps) for k in real}):
            keys = [k for k in real if (RUNGS[k].model, RUNGS[k].pretrain_steps) == (model, steps)]
            tag = model if steps == 150 else f"{model}-base{steps}"
            run_study(study_runs(keys, seeds, args, out), manifest_path=out / f"learning-{tag}.json",
                      manifest_extra={"format": "mixfleet-learning", "rungs": keys, "model": model,
                                      "pretrain_steps": steps},
                      base_policy=base_policy(model, steps), log=log,
                      settings=StudySettings(resume=args.resume, start_gap_s=5.0, run_timeout_s=5400.0))
    runs = [r for key in rungs for s in seeds
            if (r := read_run(out / key / f"seed{s}", key, s)) is not None]
    command = " ".join(["python", "benchmarks/learning.py", *(sys.argv[1:] if argv is None else argv)])
    earlier = read_earlier(Path(args.results))
    made_by = recorded_commands(earlier) if args.report_only else {}
    for r in runs:   # a report-only call made none of them: each keeps the command that ran it, if recorded
        r["command"] = made_by.get((r["rung"], r["seed"]), command)
    runs, kept = merge_earlier(runs, earlier)
    if kept:
        log(f"kept {kept} earlier run(s) of {args.results} that this command did not read (their own command "
            "is recorded with each)")
    results = {"generated_unix_s": time.time(), "command": command,
               "evaluation": {"problems": args.eval_problems, "samples_per_problem": args.eval_samples,
                              "temperature": 1.0, "top_p": "each run's eval_top_p (1: the full vocabulary)",
                              "precision": "bf16", "split": "eval"},
               "summary": summarize(runs), "runs": runs}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(json_safe(results), indent=1))
    figure = plot(runs, FIGURES) if runs else ""
    print(markdown_table(results["summary"], runs))
    for key, s in results["summary"].items():
        if isinstance(s, dict):
            a, b = s["heldout_start"], s["heldout_end"]
            print(f"{key:>10}: held-out reward {a['mean']:.3f} -> {b['mean']:.3f} "
                  f"(end min..max {b['min']:.3f}..{b['max']:.3f}, {b['n']} seeds)  {s['label']}")
    print(f"wrote {args.results}" + (f" and docs/img/{figure}" if figure else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
