"""A finished (or stopped) run's policy evaluated again, on as many held-out problems as a comparison needs.

A run evaluates itself every `eval_every` updates on `eval_problems` problems (runner/rollout/evaluation.py); that
is sized to be cheap inside the run: 64 problems x 2 samples leave a standard error of ~0.04 on one run's mean
reward, as large as the differences a study wants to tell apart (docs/learning.md). `evaluate_policy` evaluates
the policy a run left behind (its last checkpoint, `trainer_state/`, exported in the Hugging Face layout the
samplers load) or any Hugging Face layout checkpoint, with the run's own evaluation settings (task, task options,
temperature, top-p, turn cap, token cap, precision: read from its last evaluation event) on as many problems and
samples as asked. The problems are the eval split's first `problems` seeds and the sampling seeds follow from
`seed`, so two policies evaluated with the same settings see the same problems and the same random draws: their
difference is measured with common random numbers (the paired standard error in `paired_difference`).

With the run's own problem count, k and seed, the result is the run's own last evaluation, exactly (the test).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixfleet.costmodel.errors import SpecError
from mixfleet.runner.rollout.evaluation import EvalConfig, EvalResult, pass_at_k_eval

SETTINGS = ("task", "task_options", "temperature", "top_p", "max_new_tokens", "max_turns", "precision", "split")
MAX_EPISODES = 4_096                         # problems x k of one call: bounded (one engine holds them all at once)


@dataclass(frozen=True, kw_only=True)
class PolicyEvaluation:
    """One evaluation: where the policy came from, the settings, and the result with its sampling error."""
    source: str                              # the run folder or checkpoint evaluated
    kind: str                                # "run" (its trainer_state) or "checkpoint"
    version: int | None                      # the run's trained version (None: a checkpoint without one)
    settings: dict[str, Any]                 # the EvalConfig fields used (problems, k, seed included)
    reward: float                            # mean episode reward
    reward_se: float                         # its standard error over problems (per-problem means)
    pass_at_k: float
    problem_rewards: tuple[float, ...]       # each problem's mean reward over its k samples, in problem order
    wall_s: float
    problem_names: tuple[str, ...] = ()      # each problem's name (a task set's task folder, else "seed N")
    problem_solved: tuple[bool, ...] = ()    # each problem solved by any of its k samples (pass@k's count)

    def by_task(self) -> list[dict[str, Any]]:
        """The outcome per named problem, in first-seen order: a task set's tasks recur (problem i is task
        i mod n), so each task's problems, mean reward and problems solved."""
        out: dict[str, dict[str, Any]] = {}
        for name, r, ok in zip(self.problem_names, self.problem_rewards, self.problem_solved, strict=True):
            t = out.setdefault(name, {"task": name, "problems": 0, "reward_sum": 0.0, "solved": 0})
            t["problems"] += 1
            t["reward_sum"] += r
            t["solved"] += int(ok)
        return [{"task": t["task"], "problems": t["problems"], "reward": t["reward_sum"] / t["problems"],
                 "solved": t["solved"]} for t in out.values()]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"problem_rewards": list(self.problem_rewards),
                                           "problem_names": list(self.problem_names),
                                           "problem_solved": list(self.problem_solved), "by_task": self.by_task()}


def run_eval_settings(run_dir: str | Path) -> dict[str, Any]:
    """The evaluation settings a run used (its last evaluation event; the header's task and EvalConfig's defaults
    for a run that logged none, or for a setting an older log did not record)."""
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.costmodel.records.trackers import eval_detail

    log = RunLog.open(run_dir)
    base = {k: getattr(EvalConfig(), k) for k in SETTINGS}
    base["task"] = (log.header.get("runner") or {}).get("task") or base["task"]
    last: dict[str, Any] = {}
    ev = log.events
    if ev is not None and len(ev) and "kind" in ev:
        for d in ev[ev["kind"] == "note"]["detail"]:
            rec = eval_detail(d)
            if rec is not None:
                last = rec
    return base | {k: last[k] for k in SETTINGS if last.get(k) is not None}


def _state_dir(run_dir: str | Path) -> Path:
    from mixfleet.runner.orchestration.config import STATE_DIR

    state = Path(run_dir) / STATE_DIR
    if not (state / "trainer_meta.json").is_file():
        raise SpecError("evaluate", "run", str(run_dir),
                        f"a runner run folder with a checkpoint ({STATE_DIR}/trainer_meta.json); this one has none "
                        "(a twin run, or a run stopped before its first update)")
    return state


def export_run_policy(run_dir: str | Path, into: str | Path) -> tuple[Path, int]:
    """The policy of a run's last checkpoint (`trainer_state/`) written to `into` in the Hugging Face layout;
    returns (the checkpoint folder, its version)."""
    from mixfleet.runner.trainer import Trainer

    trainer = Trainer.resume(_state_dir(run_dir))
    return Path(trainer.export_hf(Path(into) / f"v{trainer.version}")), int(trainer.version)


def evaluate_policy(path: str | Path, *, problems: int, k: int, seed: int = 0, threads: int = 1,
                    **overrides: Any) -> PolicyEvaluation:
    """Evaluate a run folder's last policy (with the run's evaluation settings) or a Hugging Face layout checkpoint
    (with EvalConfig's defaults); `overrides` replace any of SETTINGS. Errors name the path and what it lacks."""
    from mixfleet.costmodel.records.runlog import RunLog
    from mixfleet.runner.checkpoint.hf_checkpoint import CONFIG_FILE, load_config

    p = Path(path)
    unknown = sorted(set(overrides) - set(SETTINGS))
    if unknown:
        raise SpecError("evaluate", "settings", ", ".join(unknown), ", ".join(SETTINGS))
    if not isinstance(problems, int) or not isinstance(k, int) or problems < 1 or k < 1 \
            or problems * k > MAX_EPISODES:
        raise SpecError("evaluate", "problems x k", f"{problems} x {k}",
                        f"integers >= 1 with problems x k <= {MAX_EPISODES}")
    is_run = RunLog.not_a_run_log(p) is None
    if not is_run and not (p / CONFIG_FILE).is_file():
        why = RunLog.not_a_run_log(p)
        raise SpecError("evaluate", "path", str(p),
                        f"a run folder (mixfleet run --out; here: {why}) or a Hugging Face layout checkpoint "
                        f"(a folder with {CONFIG_FILE})")
    if is_run:
        _state_dir(p)                                            # before anything is read or built
    settings = (run_eval_settings(p) if is_run else {k_: getattr(EvalConfig(), k_) for k_ in SETTINGS}) | {
        k_: v for k_, v in overrides.items() if v is not None}
    cfg = EvalConfig(problems=problems, k=k, seed=seed, threads=threads,
                     **{k_: v for k_, v in settings.items() if k_ != "task_options"},
                     task_options=dict(settings.get("task_options") or {}))
    with tempfile.TemporaryDirectory(prefix="mixfleet-eval-") as tmp:
        if is_run:
            checkpoint, version = export_run_policy(p, tmp)
        else:
            checkpoint = p
            wv = load_config(p).weight_version
            version = int(wv) if str(wv).isdigit() else None
        res = asyncio.run(pass_at_k_eval(checkpoint, cfg))
    return _evaluation(str(p), "run" if is_run else "checkpoint", version, cfg, res)


def _evaluation(source: str, kind: str, version: int | None, cfg: EvalConfig, res: EvalResult) -> PolicyEvaluation:
    per_problem = tuple(statistics.fmean(res.rewards[i * cfg.k:(i + 1) * cfg.k]) for i in range(cfg.problems))
    se = statistics.stdev(per_problem) / math.sqrt(len(per_problem)) if len(per_problem) > 1 else math.nan
    settings = {"problems": cfg.problems, "k": cfg.k, "seed": cfg.seed, "split": "eval",
                **{k: getattr(cfg, k) for k in SETTINGS}}
    solved = tuple(any(r >= cfg.success_reward for r in res.rewards[i * cfg.k:(i + 1) * cfg.k])
                   for i in range(cfg.problems))
    return PolicyEvaluation(source=source, kind=kind, version=version, settings=settings, reward=res.reward_mean,
                            reward_se=se, pass_at_k=res.pass_at_k, problem_rewards=per_problem, wall_s=res.wall_s,
                            problem_names=res.problem_names, problem_solved=solved)


def paired_difference(a: PolicyEvaluation | dict[str, Any], b: PolicyEvaluation | dict[str, Any]) -> dict[str, float]:
    """a's mean reward minus b's over the same problems and random draws, with the standard error of the
    per-problem differences (smaller than the two standard errors combined when the draws are shared)."""
    ra, rb = (x.to_dict() if isinstance(x, PolicyEvaluation) else x for x in (a, b))
    sa, sb = ({"split": "eval", **r["settings"]} for r in (ra, rb))   # recorded before "split": the eval split
    if sa != sb:
        diff = {k: (sa.get(k), sb.get(k)) for k in sa | sb if sa.get(k) != sb.get(k)}
        raise ValueError(f"paired_difference: the evaluations differ in their settings {json.dumps(diff)}; "
                         "a paired difference needs the same problems, k, seed and sampling")
    d = [x - y for x, y in zip(ra["problem_rewards"], rb["problem_rewards"], strict=True)]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.nan
    return {"difference": statistics.fmean(d), "se": se}
