"""Synchronous on-policy RL in one process: the run's own parts (embedded engine, agent loop, batch, Megatron-core
trainer, corrections loss), no Ray and no fleet.

Why: the first rung of the learning ladder (docs/learning.md) and the CI learning test need the plainest RL loop
there is, where nothing but the loss and the optimizer can keep the policy from learning:

    for update in 1..N:
        episodes = P prompts x G samples, sampled at T by the engine holding version update - 1
        batch    = build_batch(episodes)              # runner/orchestration/batching.py, GRPO advantages
        trainer.train_step(batch, corrections loss)   # one AdamW step (runner/trainer)
        engine.update_weights_from_disk(export)       # the next episodes use the new version

The sampler holds the trainer's own weights in the trainer's precision (fp32 weights, kernel and KV), so the
batch is exactly on-policy: the sampler-trainer k3 is ~1e-13 (it is reported per update). Held-out evaluation
is the runner's (`runner/rollout/evaluation.py`): `eval_problems` problems of the task's eval split, `eval_samples`
episodes each at the run's temperature over the full vocabulary, on a bf16 engine loading the exported version;
its mean reward is "held-out reward at T" and pass@k comes with it. Everything is seeded: the same config on the
same machine gives the same curve.

    from mixfleet.runner.orchestration.onpolicy import OnPolicyConfig, train_on_policy
    result = train_on_policy(base_checkpoint, OnPolicyConfig(updates=10), out_dir=Path("runs/onpolicy"))
    result.evals[-1]["reward"] - result.evals[0]["reward"]
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.runner.rollout.agent import FINISH_NO_TOOL_CALL, AgentConfig, Episode, engine_generate, run_episode
from mixfleet.runner.rollout.tasks import make_task
from mixfleet.runner.sampler.engine_api import TOP_P_ALLOWED, valid_top_p

TRAIN_SEED_SPAN = 10**8                      # training problems are drawn from the train split's first seeds


@dataclass(frozen=True, kw_only=True)
class OnPolicyConfig:
    """One on-policy run (validated on construction; the defaults are the learning ladder's rung a0)."""

    updates: int = 20
    prompts_per_update: int = 8
    samples_per_prompt: int = 8
    loss: str = "grpo"                       # CorrectionConfig.method; on-policy every method is grpo
    loss_agg: str = "seq_mean_token_mean"    # CorrectionConfig.loss_agg
    advantage_std: bool = True               # GRPO advantages over their prompt-group's std
    lr: float = 3e-4
    lr_warmup_steps: int = 3
    grad_clip_norm: float = 1.0
    task: str = "guess"
    task_options: dict[str, Any] = field(default_factory=dict)
    max_turns: int = 8
    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0                       # < 1: top-p sampling, the kept sets recorded and replayed in the loss
    top_k_record: int = 16                   # top-K log-probs recorded per token for the centered losses (sc*)
    lag: int = 0                             # > 0: the sampler holds version u - lag while the trainer makes u + 1
                                             # (a fixed staleness, for diagnosis; then the loop is off-policy)
    eval_every: int = 5                      # updates between held-out evaluations (0: only before and after)
    eval_problems: int = 64
    eval_samples: int = 2
    eval_top_p: float = 1.0                  # the held-out evaluation's nucleus (1: full vocabulary; EvalConfig.top_p)
    seed: int = 0
    threads: int = 2                         # torch threads (engine and trainer share them: one runs at a time)

    def __post_init__(self) -> None:
        for name, lo in (("updates", 1), ("prompts_per_update", 1), ("samples_per_prompt", 2), ("max_turns", 1),
                         ("max_new_tokens", 1), ("eval_every", 0), ("eval_problems", 1), ("eval_samples", 1),
                         ("seed", 0), ("threads", 1), ("lr_warmup_steps", 0), ("lag", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"OnPolicyConfig.{name} = {v!r}; allowed: an integer >= {lo}")
        if not (isinstance(self.lr, int | float) and 0 < self.lr < 1):
            raise ValueError(f"OnPolicyConfig.lr = {self.lr!r}; allowed: a number in (0, 1)")
        if not self.temperature > 0:
            raise ValueError(f"OnPolicyConfig.temperature = {self.temperature!r}; allowed: > 0")
        for name in ("top_p", "eval_top_p"):
            if not valid_top_p(getattr(self, name)):
                raise ValueError(f"OnPolicyConfig.{name} = {getattr(self, name)!r}; allowed: {TOP_P_ALLOWED}")
        self.correction()                                # loss / loss_agg named with their allowed values
        make_task(self.task, **self.task_options)

    def correction(self) -> Any:
        from mixfleet.runner.corrections import CorrectionConfig

        return CorrectionConfig(method=self.loss, loss_agg=self.loss_agg, temperature=self.temperature,
                                top_p_replay=self.top_p < 1)


@dataclass(kw_only=True)
class OnPolicyResult:
    config: dict[str, Any]
    base_checkpoint: str
    updates: list[dict[str, float]]          # per update: reward, k3, entropy, grad_norm, no_tool_call_share, ...
    evals: list[dict[str, Any]]              # per evaluation: version, reward (held-out, at T), pass_at_k, ...
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


ProgressFn = Callable[[str, dict[str, Any]], None]


def _episode_stats(eps: list[Episode]) -> dict[str, float]:
    n = len(eps)
    return {"reward": sum(e.reward for e in eps) / n,
            "no_tool_call_share": sum(e.finish_reason == FINISH_NO_TOOL_CALL for e in eps) / n,
            "turns": sum(e.num_turns for e in eps) / n,
            "generated_tokens": sum(e.num_generated for e in eps) / n}


def train_on_policy(base_checkpoint: str | Path, config: OnPolicyConfig | None = None, *, out_dir: Path,
                    progress: ProgressFn | None = None) -> OnPolicyResult:
    """Run `config` from `base_checkpoint` (an HF layout checkpoint); exports go to `out_dir` (one version at a
    time, removed at the end). `progress(kind, record)` is called with ("update", ...) and ("eval", ...)."""
    import torch
    from mixfleet.runner.orchestration.batching import BatchItem, BatchOptions, build_batch, correction_batch
    from mixfleet.runner.rollout.evaluation import EvalConfig, pass_at_k_eval
    from mixfleet.runner.sampler.engine import Engine
    from mixfleet.runner.sampler.engine_api import SamplingParams
    from mixfleet.runner.trainer import Trainer
    from mixfleet.runner.trainer.trainer import OptimizerConfig, TrainerConfig, policy_loss_fn

    cfg = config or OnPolicyConfig()
    torch.set_num_threads(cfg.threads)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    trainer = Trainer.from_checkpoint(base_checkpoint, TrainerConfig(optimizer=OptimizerConfig(
        lr=cfg.lr, warmup_steps=cfg.lr_warmup_steps, grad_clip_norm=cfg.grad_clip_norm)))
    trainer.version = 0
    loss_fn = policy_loss_fn(cfg.correction(), correction=correction_batch)
    n_eps = cfg.prompts_per_update * cfg.samples_per_prompt
    engine = Engine(str(base_checkpoint), precision="fp32", kernel="fp32", kv_cache_dtype="fp32", seed=cfg.seed,
                    weight_version="0", max_running_requests=n_eps)
    stop = threading.Event()
    thread = threading.Thread(target=engine.run_forever, args=(stop,), name="onpolicy-engine", daemon=True)
    thread.start()
    replay = cfg.top_p < 1
    top_k = cfg.top_k_record if cfg.correction().centered else 0      # the centered losses' head; grpo needs none
    generate = engine_generate(engine, top_logprobs_num=top_k, return_sampling_mask=replay)
    eval_cfg = EvalConfig(task=cfg.task, task_options=cfg.task_options, problems=cfg.eval_problems,
                          k=cfg.eval_samples, max_turns=cfg.max_turns, max_new_tokens=cfg.max_new_tokens,
                          temperature=cfg.temperature, top_p=cfg.eval_top_p, seed=cfg.seed, threads=cfg.threads)
    rng = random.Random(cfg.seed)
    updates: list[dict[str, float]] = []
    evals: list[dict[str, Any]] = []

    def evaluate(version: int, checkpoint: str | Path) -> None:
        res = asyncio.run(pass_at_k_eval(checkpoint, eval_cfg))
        rec = {"version": version, "reward": res.reward_mean, "pass_at_k": res.pass_at_k, "k": res.k,
               "problems": res.problems, "episodes": res.problems * res.k, "wall_s": res.wall_s}
        evals.append(rec)
        if progress is not None:
            progress("eval", rec)

    async def sample(update: int) -> list[Episode]:
        seeds = [rng.randrange(TRAIN_SEED_SPAN) for _ in range(cfg.prompts_per_update)]
        base_seed = (cfg.seed * 1_000_003 + update) * 10_007
        return list(await asyncio.gather(*[
            run_episode(make_task(cfg.task, **cfg.task_options), s, generate, session_id=f"u{update}-p{i}-s{j}",
                        config=AgentConfig(context_length=engine.context_length, max_turns=cfg.max_turns,
                                           sampling=SamplingParams(max_new_tokens=cfg.max_new_tokens,
                                                                   temperature=cfg.temperature, top_p=cfg.top_p,
                                                                   sampling_seed=base_seed + 97 * (i * 64 + j))))
            for i, s in enumerate(seeds) for j in range(cfg.samples_per_prompt)]))

    try:
        evaluate(0, base_checkpoint)
        for u in range(1, cfg.updates + 1):
            ts = time.perf_counter()
            eps = asyncio.run(sample(u))
            items = [BatchItem(episode=e, prompt_id=k // cfg.samples_per_prompt,
                               sample_index=k % cfg.samples_per_prompt) for k, e in enumerate(eps)]
            batch = build_batch(items, trained_version=u, group_names=["onpolicy"],
                                options=BatchOptions(normalize_std=cfg.advantage_std, top_k=top_k,
                                                     top_p_replay=replay))
            sample_s = time.perf_counter() - ts
            m = trainer.train_step(dict(batch.tensors), loss_fn)
            export = trainer.export_hf(out_dir / f"v{u}", u)
            serve = u - cfg.lag
            if serve >= 1:
                ok, msg = engine.update_weights_from_disk(str(out_dir / f"v{serve}"), str(serve))
                if not ok:
                    raise RuntimeError(f"on-policy loop: the sampler could not load version {serve}: {msg}")
            rec = {"version": u, **_episode_stats(eps), "k3": float(m.get("k3", math.nan)),
                   "entropy": float(m.get("entropy", math.nan)), "grad_norm": float(m["grad_norm"]),
                   "lr": float(m["lr"]), "sample_s": sample_s, "train_s": float(m["step_s"])}
            updates.append(rec)
            if progress is not None:
                progress("update", rec)
            if (cfg.eval_every and u % cfg.eval_every == 0) or u == cfg.updates:
                evaluate(u, export)
            if u - cfg.lag > 1:
                shutil.rmtree(out_dir / f"v{u - cfg.lag - 1}", ignore_errors=True)
    finally:
        stop.set()
        thread.join(timeout=10)
    for v in range(max(1, cfg.updates - cfg.lag), cfg.updates + 1):
        shutil.rmtree(out_dir / f"v{v}", ignore_errors=True)
    return OnPolicyResult(config=json.loads(json.dumps(asdict(cfg))), base_checkpoint=str(base_checkpoint),
                          updates=updates, evals=evals, wall_s=time.perf_counter() - t0)

