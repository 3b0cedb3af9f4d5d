"""The base policy: the tiny model trained by supervised imitation of synthetic demonstrations.

RL needs a starting policy whose reward is clearly nonzero (so groups of samples have different
rewards to learn from) but well below 1 (so there is something to learn). `pretrain` makes one:
scripted, slightly noisy demonstrations (runner/rollout/demos.py) -> packed token rows -> cross-entropy on
the generated tokens only (the same loss mask RL uses) with the Megatron-core Trainer
(runner/trainer/) -> a Hugging Face layout checkpoint with the tokenizer, which every sampler loads.

Caching: the checkpoint lands in `<cache_dir>/<key>/` (default `~/.cache/mixfleet/base/<key>/`,
or `$MIXFLEET_CACHE/base/<key>/`), where `key` hashes the model spec's content, the demonstration
settings, the training settings and the seed. A later call with the same inputs reuses it (unless
`force`); `pretrain.json` beside the weights records the settings, the loss curve and timings, and
its presence marks a complete entry (entries are written under a temporary name and renamed).

`measure_reward` samples episodes of the held-out split with the embedded engine (runner/sampler/engine/)
to report the base policy's reward.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mixfleet.costmodel.paths import cache_root
from mixfleet.costmodel.specs.model import ModelSpec, load_model_spec
from mixfleet.runner.orchestration.config import run_settings, task_of
from mixfleet.runner.rollout.agent import AgentConfig, Episode, engine_generate, run_episode
from mixfleet.runner.rollout.demos import DEMO_FORMAT, DEMO_REPLY_TOKENS, DemoConfig, demo_stats, generate_demos
from mixfleet.runner.rollout.tasks import make_task, split_seeds
from mixfleet.runner.sampler.engine_api import SamplingParams

CACHE_FORMAT = 1                          # bump when the training recipe changes meaning
META_FILE = "pretrain.json"
PAD_SEGMENT = -1


def default_cache_dir() -> Path:
    """`base/` under mixfleet's cache (costmodel.paths.cache_root: `$MIXFLEET_CACHE` or `~/.cache/mixfleet`)."""
    return cache_root("base")


@dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    """Everything that determines the base policy (all of it goes into the cache key)."""

    model: str = "tiny"                   # model spec name (data/models) or path to a spec TOML
    demos: DemoConfig = field(default_factory=DemoConfig)
    steps: int = 150                      # optimizer steps
    rows_per_step: int = 2                # packed rows per step
    row_tokens: int | None = None         # tokens per packed row (<= the model's context; None: the context)
    lr: float = 2e-3                      # AdamW peak learning rate (constant after warmup)
    warmup_steps: int = 10
    weight_decay: float = 0.0
    seed: int = 0                         # model init and row order
    lr_decay: bool = False                # cosine from lr to 0 over the steps instead of constant
    init_from: str | None = None          # a base made by pretrain (its folder) to go on training instead of a
                                          # fresh init (its key goes into this one's; same model spec)

    def __post_init__(self) -> None:
        for name, lo in (("steps", 1), ("rows_per_step", 1), ("row_tokens", 16), ("warmup_steps", 0)):
            v = getattr(self, name)
            if name == "row_tokens" and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"pretrain.{name}: {v!r} must be an integer >= {lo}")
        if not (isinstance(self.lr, int | float) and 0 < self.lr < 1):
            raise ValueError(f"pretrain.lr: {self.lr!r} must be a number in (0, 1)")
        if not (isinstance(self.weight_decay, int | float) and self.weight_decay >= 0):
            raise ValueError(f"pretrain.weight_decay: {self.weight_decay!r} must be a number >= 0")
        if self.lr_decay and self.steps <= self.warmup_steps:
            raise ValueError(f"pretrain.lr_decay: needs steps ({self.steps}) > warmup_steps ({self.warmup_steps})")

    def init_meta(self) -> dict[str, Any] | None:
        """pretrain.json of the base `init_from` names (None without one); a folder that is not a base made by
        pretrain, or one of another model spec, is a ValueError naming it."""
        if self.init_from is None:
            return None
        meta_path = Path(self.init_from) / META_FILE
        if not meta_path.exists():
            raise ValueError(f"pretrain.init_from: {self.init_from!r} is not a base made by `mixfleet pretrain` "
                             f"(no {META_FILE}); allowed: a folder of the base cache or a --out copy")
        meta = json.loads(meta_path.read_text())
        if meta.get("spec") != self.spec().to_dict():
            raise ValueError(f"pretrain.init_from: {self.init_from!r} is a base of model {meta.get('model')!r}, "
                             f"not of {self.model!r} (same spec needed)")
        return meta

    def spec(self) -> ModelSpec:
        return load_model_spec(self.model)


@dataclass(frozen=True, kw_only=True)
class PretrainResult:
    path: Path                            # the checkpoint folder (HF layout + tokenizer.json + pretrain.json)
    key: str                              # cache key
    reused: bool                          # True when the cache already had it
    meta: dict[str, Any]                  # the contents of pretrain.json


def base_folder(ref: str, cache_dir: str | Path | None = None) -> str:
    """A base named by its folder or by its cache key (a folder of the cache, `default_cache_dir` unless given)."""
    cached = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / ref
    return str(cached) if not Path(ref).exists() and cached.exists() else ref


def cache_key(config: PretrainConfig) -> str:
    """Hash of the spec's content, demonstration + training settings and the seed (24 hex chars);
    settings left to their model-dependent default hash as their resolved value."""
    spec = config.spec()
    resolved = dataclasses.replace(config, row_tokens=config.row_tokens or spec.max_context)
    payload = {"format": CACHE_FORMAT, "spec": spec.to_dict(), "config": dataclasses.asdict(resolved)}
    if config.demos.task in DEMO_FORMAT:
        payload["demo_format"] = DEMO_FORMAT[config.demos.task]
    payload["config"].pop("model")        # the content counts, not the name or path it was read from
    for name in ("lr_decay", "init_from"):   # added later: at their defaults, the keys of earlier bases hold
        if payload["config"][name] == getattr(PretrainConfig, name):
            payload["config"].pop(name)
    init = config.init_meta()
    if init is not None:
        payload["config"]["init_from"] = init["key"]      # the starting weights, not the folder they lie in
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def pack_episodes(episodes: list[Episode], row_tokens: int, rng: random.Random) -> list[dict[str, list[int]]]:
    """Shuffle episodes and pack them whole into rows of `row_tokens` (first fit in order; padding last).

    Each row: `input_ids`, `segment_ids` (episode index within the row; PAD_SEGMENT on padding) and
    `loss_mask` (1 where the token was generated). Episodes longer than a row are cut to it.
    """
    order = list(range(len(episodes)))
    rng.shuffle(order)
    rows: list[dict[str, list[int]]] = []
    cur: dict[str, list[int]] = {"input_ids": [], "segment_ids": [], "loss_mask": []}
    seg = 0
    for i in order:
        ep = episodes[i]
        n = min(len(ep.tokens), row_tokens)
        if len(cur["input_ids"]) + n > row_tokens:
            rows.append(cur)
            cur, seg = {"input_ids": [], "segment_ids": [], "loss_mask": []}, 0
        cur["input_ids"].extend(ep.tokens[:n])
        cur["segment_ids"].extend([seg] * n)
        cur["loss_mask"].extend(ep.loss_mask[:n])
        seg += 1
    if cur["input_ids"]:
        rows.append(cur)
    for row in rows:
        pad = row_tokens - len(row["input_ids"])
        row["input_ids"].extend([0] * pad)
        row["segment_ids"].extend([PAD_SEGMENT] * pad)
        row["loss_mask"].extend([0] * pad)
    return rows


def sft_loss(logits: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    """Mean next-token cross-entropy over generated target tokens (loss_mask of the target = 1)."""
    import torch

    ids, mask, seg = batch["input_ids"], batch["loss_mask"], batch["segment_ids"]
    target = ids[:, 1:].to(logits.device)
    weight = (mask[:, 1:] * (seg[:, 1:] == seg[:, :-1])).to(logits.device, torch.float32)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, target[..., None])[..., 0]
    n = weight.sum().clamp(min=1.0)
    loss = -(logp * weight).sum() / n
    with torch.no_grad():
        acc = ((logits[:, :-1].argmax(-1) == target).float() * weight).sum() / n
    return loss, {"token_accuracy": acc, "loss_tokens": weight.sum()}


ProgressFn = Callable[[int, int, dict[str, float]], None]


def train_base_policy(config: PretrainConfig, out_dir: Path, *, progress: ProgressFn | None = None,
                      demo_progress: Callable[[int, int], Any] | None = None) -> dict[str, Any]:
    """Generate demonstrations (`demo_progress(done, total)` after each), train (`progress(step, steps, metrics)`
    after each step), export to `out_dir` (HF layout); returns the metadata dict."""
    import torch
    from mixfleet.runner.trainer import OptimizerConfig, Trainer, TrainerConfig
    from mixfleet.runner.trainer.megatron_model import BuildOptions

    spec = config.spec()
    row_tokens = config.row_tokens or spec.max_context
    if row_tokens > spec.max_context:
        raise ValueError(f"pretrain.row_tokens: {row_tokens} exceeds model '{spec.name}' context {spec.max_context}")
    t0 = time.perf_counter()
    agent = AgentConfig(context_length=spec.max_context)
    episodes = generate_demos(config.demos, agent=agent, on_episode=demo_progress)
    stats = demo_stats(episodes)
    t_demos = time.perf_counter() - t0
    trainer_config = TrainerConfig(
        optimizer=OptimizerConfig(lr=config.lr, warmup_steps=config.warmup_steps, weight_decay=config.weight_decay,
                                  decay_steps=config.steps if config.lr_decay else 0),
        build=BuildOptions(device="cpu", seed=config.seed))
    if config.init_meta() is not None:
        trainer = Trainer.from_checkpoint(config.init_from, trainer_config)      # version 0: the schedule anew
    else:
        trainer = Trainer(spec, trainer_config)
    rng = random.Random(config.seed)
    rows: list[dict[str, list[int]]] = []
    losses: list[float] = []
    accs: list[float] = []
    epochs = 0
    t1 = time.perf_counter()
    for step in range(config.steps):
        if len(rows) < config.rows_per_step:
            rows.extend(pack_episodes(episodes, row_tokens, rng))
            epochs += 1
        chunk, rows = rows[: config.rows_per_step], rows[config.rows_per_step:]
        batch = {k: torch.tensor([r[k] for r in chunk], dtype=torch.long) for k in chunk[0]}
        m = trainer.train_step(batch, sft_loss)
        losses.append(float(m["loss"]))
        accs.append(float(m["token_accuracy"]))
        if progress is not None:
            progress(step + 1, config.steps, {"loss": losses[-1], "token_accuracy": accs[-1]})
    t_train = time.perf_counter() - t1
    trainer.export_hf(out_dir, version=0)
    return {"format": CACHE_FORMAT, "model": spec.name, "spec": spec.to_dict(),
            "config": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
            "demo_stats": stats, "losses": losses, "token_accuracy": accs, "epochs": epochs,
            "demos_s": t_demos, "train_s": t_train, "created_unix_s": time.time()}


def pretrain(config: PretrainConfig | None = None, *, cache_dir: str | Path | None = None, force: bool = False,
             out: str | Path | None = None, progress: ProgressFn | None = None,
             demo_progress: Callable[[int, int], Any] | None = None) -> PretrainResult:
    """The base policy checkpoint for `config`: from the cache, or trained now and cached (`progress`,
    `demo_progress`: see `train_base_policy`).

    `out`: also copy the checkpoint folder there (created; existing files of the same names replaced).
    """
    config = config or PretrainConfig()
    spec = config.spec()
    if (config.row_tokens or 0) > spec.max_context:
        raise ValueError(f"pretrain.row_tokens: {config.row_tokens} exceeds model '{spec.name}' context "
                         f"{spec.max_context}")
    key = cache_key(config)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / key
    meta_path = final / META_FILE
    reused = meta_path.exists() and not force
    if reused:
        meta = json.loads(meta_path.read_text())
    else:
        root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            ckpt = work / "ckpt"
            meta = train_base_policy(config, ckpt, progress=progress, demo_progress=demo_progress)
            meta["key"] = key
            (ckpt / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            if final.exists():                                  # forced, or a stale incomplete entry
                os.replace(final, work / "old")
            try:
                os.replace(ckpt, final)
            except OSError:                                     # another process finished the same key first
                if not (final / META_FILE).exists():
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if out is not None:
        shutil.copytree(final, Path(out), dirs_exist_ok=True)
    return PretrainResult(path=Path(out) if out is not None else final, key=key, reused=reused, meta=meta)


def demo_options(task: str, options: dict[str, Any]) -> dict[str, Any]:
    """The task options that change a demonstration: those set to a value other than the task's default, less
    its resource options (a repo plan's 24-sandbox pool trains the same base as `mixfleet pretrain --task repo`,
    and finds it in the cache). Bad options raise the task's own ValueError."""
    from mixfleet.runner.rollout.tasks import task_config

    default = task_config(task)
    task_config(task, **options)                                   # checked: field, value, allowed
    skip = set(getattr(type(default), "RESOURCE_OPTIONS", ()))
    return {k: v for k, v in options.items() if k not in skip and getattr(default, k) != v}


def plan_base_config(plan: Any) -> PretrainConfig:
    """The base policy a run of `plan` starts from when it is given none: `mixfleet pretrain` on the plan's model,
    on demonstrations of the plan's task (embedded.task and its options, but a repo `task_set`: the demonstrations
    use generated repositories), for the plan's embedded.base_steps (0: pretrain's default). A plan without
    [embedded] settings gets pretrain's defaults on its model."""
    emb = run_settings(plan)
    kw: dict[str, Any] = {"model": plan.model}
    name = task_of(plan)
    options = dict(emb.task_options)
    options.pop("task_set", None)      # a task set has no ground truth to demonstrate: generated repos instead
    kw["demos"] = DemoConfig(task=name, task_options=tuple(sorted(demo_options(name, options).items())))
    if emb.base_steps:
        kw["steps"] = emb.base_steps
    return PretrainConfig(**kw)


@dataclass(frozen=True, kw_only=True)
class RewardReport:
    task: str
    episodes: int
    reward: float                          # mean reward
    finish_reasons: dict[str, float]       # share of episodes per finish reason
    mean_turns: float
    mean_generated_tokens: float
    wall_s: float


def sample_episodes(checkpoint: str | Path, *, task: str = "guess", task_options: dict[str, Any] | None = None,
                    episodes: int = 64, split: str = "eval", offset: int = 0, precision: str = "bf16",
                    temperature: float = 1.0, seed: int = 0, max_new_tokens: int | None = None) -> list[Episode]:
    """`episodes` episodes of the checkpoint's policy on problems of a split (seeds `split_seeds(split, episodes,
    offset)`, in that order), sampled concurrently with the embedded engine (full vocabulary at `temperature`;
    per-request seeds, so repeatable). `max_new_tokens` per reply: None = 48, or the task's demonstrations' reply
    cap when larger (demos.DEMO_REPLY_TOKENS: repo 128). An episode that failed is a RuntimeError."""
    from mixfleet.runner.sampler.engine import Engine

    engine = Engine(checkpoint, precision=precision, kernel="fp32" if precision == "fp32" else None, seed=seed,
                    max_running_requests=max(1, episodes))
    stop = threading.Event()
    thread = threading.Thread(target=engine.run_forever, args=(stop,), name="pretrain-eval-engine", daemon=True)
    thread.start()
    options = task_options or {}
    if max_new_tokens is None:
        max_new_tokens = max(48, DEMO_REPLY_TOKENS.get(task, 0))
    generate = engine_generate(engine)
    seeds = split_seeds(split, episodes, offset=offset)

    async def run_all() -> list[Episode]:
        return list(await asyncio.gather(*[
            run_episode(make_task(task, **options), s, generate, session_id=f"eval-{task}-{s}",
                        config=AgentConfig(context_length=engine.context_length,
                                           sampling=SamplingParams(max_new_tokens=max_new_tokens,
                                                                   temperature=temperature,
                                                                   sampling_seed=seed * 1_000_003 + i * 101)))
            for i, s in enumerate(seeds)]))

    try:
        eps = asyncio.run(run_all())
    finally:
        stop.set()
        thread.join(timeout=10)
    errors = [e.error for e in eps if e.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(eps)} evaluation episodes failed; first: {errors[0]}")
    return eps


def measure_reward(checkpoint: str | Path, *, task: str = "guess", task_options: dict[str, Any] | None = None,
                   episodes: int = 64, split: str = "eval", offset: int = 0, precision: str = "bf16",
                   temperature: float = 1.0, seed: int = 0, max_new_tokens: int | None = None) -> RewardReport:
    """Mean reward of the checkpoint's policy over `episodes` problems of a split (`sample_episodes`), with the
    finish reasons, turns and tokens per episode."""
    t0 = time.perf_counter()
    eps = sample_episodes(checkpoint, task=task, task_options=task_options, episodes=episodes, split=split,
                          offset=offset, precision=precision, temperature=temperature, seed=seed,
                          max_new_tokens=max_new_tokens)
    n = len(eps)
    reasons: dict[str, float] = {}
    for e in eps:
        reasons[e.finish_reason] = reasons.get(e.finish_reason, 0.0) + 1.0 / n
    return RewardReport(task=task, episodes=n, reward=sum(e.reward for e in eps) / n, finish_reasons=reasons,
                        mean_turns=sum(e.num_turns for e in eps) / n,
                        mean_generated_tokens=sum(e.num_generated for e in eps) / n,
                        wall_s=time.perf_counter() - t0)
