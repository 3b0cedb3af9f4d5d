"""The RL trainer: a Megatron-core GPTModel, a plain torch AdamW, HF export and resumable state.

Why: the runner needs one object that (1) turns token ids into logits of the policy, (2) takes one
optimizer step per update with whatever loss the corrections module computes, (3) writes the weights
in the Hugging Face layout every sampler loads, atomically, and (4) can be killed at any moment and
resumed bit-exactly. Model construction lives in `megatron_model.py`, the layout conversion in
`hf_export.py`; this file is the training loop's state machine.

Conventions:
- `logits[b, t]` is the distribution of the token at position t + 1 (the usual causal shift);
  logits are float32 and cover the real vocabulary only (Megatron's padding rows are cut off).
- A batch is a mapping with `input_ids` [B, S] (int64) and optionally `position_ids` [B, S] and
  `segment_ids` [B, S] (packed rows: tokens attend causally within their own segment only;
  positions restart at each segment when `position_ids` is not given). Anything else in the batch
  (labels, advantages, masks, sampler log-probs...) is for the loss function.
- `loss_fn(logits, batch) -> (loss, metrics)`; e.g. the corrections module:
  `lambda logits, batch: policy_loss(logits, batch, cfg)`. Or an `OutputLayerLoss` on the output
  layer's input and weight (`policy_loss_fn(cfg)`: the corrections' fused loss), for which the model
  runs without its output layer and no [B, S, V] logits are built.
- `version` counts optimizer steps taken (0 = initial weights); exports carry it as the weight version.
- Weight decay applies to matrices (ndim >= 2) only, never to norm weights. The learning rate is
  constant after an optional linear warmup, computed from `version` (so resuming needs no scheduler).
- A step whose gradient norm is not finite is skipped (weights and version unchanged, `skipped` = 1).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import pickle
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mixfleet.costmodel.specs.model import ModelSpec, model_spec_from_dict
from mixfleet.runner.checkpoint.hf_checkpoint import (
    HFConfig,
    NonFiniteWeightsError,
    load_checkpoint,
    load_config,
    replace_dir_atomically,
    save_checkpoint,
)
from mixfleet.runner.checkpoint.tokenizer import TOKENIZER_FILE, ByteTokenizer
from mixfleet.runner.trainer import routing
from mixfleet.runner.trainer.hf_export import (
    hf_to_megatron,
    load_into_model,
    megatron_to_hf,
    uses_fused_norms,
    uses_grouped_experts,
)
from mixfleet.runner.trainer.megatron_model import (
    BuildOptions,
    BuiltModel,
    build_gpt_model,
    moe_routers,
    output_layer_weight,
    without_output_layer,
)
from mixfleet.runner.trainer.routing import check_routing_mode

LossFn = Callable[[torch.Tensor, Mapping[str, Any]], tuple[torch.Tensor, Mapping[str, Any]]]

STATE_FILE = "trainer_state.pt"
META_FILE = "trainer_meta.json"
STATE_FORMAT = 1
EXPORT_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """AdamW settings; `grad_clip_norm` <= 0 disables clipping (the norm is still reported)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    warmup_steps: int = 0
    decay_steps: int = 0        # 0: constant after warmup; else cosine from lr to 0 at this step (then 0)

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, int | float) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"OptimizerConfig.lr = {self.lr!r}; allowed: a finite number > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"OptimizerConfig.betas = {self.betas!r}; allowed: two numbers in [0, 1)")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        if not self.eps > 0:
            raise ValueError(f"OptimizerConfig.eps = {self.eps!r}; allowed: > 0")
        if not self.weight_decay >= 0:
            raise ValueError(f"OptimizerConfig.weight_decay = {self.weight_decay!r}; allowed: >= 0")
        if not math.isfinite(self.grad_clip_norm):
            raise ValueError(f"OptimizerConfig.grad_clip_norm = {self.grad_clip_norm!r}; allowed: a finite number "
                             "(<= 0 disables clipping)")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps = {self.warmup_steps!r}; allowed: an integer >= 0")
        if not isinstance(self.decay_steps, int) or isinstance(self.decay_steps, bool) or not (
                self.decay_steps == 0 or self.decay_steps > self.warmup_steps):
            raise ValueError(f"OptimizerConfig.decay_steps = {self.decay_steps!r}; allowed: 0 (no decay) or an "
                             f"integer > warmup_steps ({self.warmup_steps})")

    def lr_at(self, step: int) -> float:
        """Learning rate of the optimizer step that produces version step + 1: linear warmup over warmup_steps,
        then constant, or (decay_steps > 0) a cosine from lr down to 0 at step decay_steps."""
        scale = 1.0 if self.warmup_steps == 0 else min(1.0, (step + 1) / self.warmup_steps)
        if self.decay_steps and step >= self.warmup_steps:
            done = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
            scale = 0.5 * (1.0 + math.cos(math.pi * done))
        return float(self.lr) * scale


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Optimizer + how the model is built + how weights are exported."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    build: BuildOptions = field(default_factory=BuildOptions)
    export_dtype: str = "float32"            # float32 | bfloat16 (samplers re-quantize from it)
    routing: str = "free"                    # MoE: free (own router) | replay (the sampler's experts; routing.py)

    def __post_init__(self) -> None:
        if self.export_dtype not in EXPORT_DTYPES:
            raise ValueError(f"TrainerConfig.export_dtype = {self.export_dtype!r}; allowed: {', '.join(EXPORT_DTYPES)}")
        check_routing_mode(self.routing, "TrainerConfig.routing")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainerConfig:
        opt = dict(d.get("optimizer", {}))
        if "betas" in opt:
            opt["betas"] = tuple(opt["betas"])
        return cls(optimizer=OptimizerConfig(**opt), build=BuildOptions(**d.get("build", {})),
                   export_dtype=d.get("export_dtype", "float32"), routing=d.get("routing", "free"))


@dataclass(frozen=True)
class OutputLayerLoss:
    """A loss on the output layer's input and weight instead of its logits: `fn(hidden, weight, batch)`
    with hidden [B * S, H] (row b * S + t predicts input_ids[b, t + 1]) and weight [vocab_size, H].
    `Trainer.train_step` runs the model without its output layer for it, so the [B, S, V] logits are
    never built (the loss fuses the output layer, e.g. `corrections.policy_loss_from_hidden`)."""

    fn: Callable[[torch.Tensor, torch.Tensor, Mapping[str, Any]], tuple[torch.Tensor, Mapping[str, Any]]]

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor,
                 batch: Mapping[str, Any]) -> tuple[torch.Tensor, Mapping[str, Any]]:
        return self.fn(hidden, weight, batch)


def _batch_correction(batch: Mapping[str, Any]) -> Any:
    if "correction" not in batch:
        raise ValueError(f"batch has no 'correction' (a CorrectionBatch); keys: {sorted(batch)}")
    return batch["correction"]


def policy_loss_fn(config: Any, *, fused: bool = True,
                   correction: Callable[[Mapping[str, Any]], Any] | None = None) -> OutputLayerLoss | LossFn:
    """The corrections module's policy loss with `config` (a CorrectionConfig), for `train_step`.

    `correction(batch)` gives the `CorrectionBatch` (default: `batch["correction"]`) of T = B * S
    positions aligned with the flattened rows, i.e. position b * S + t predicts `input_ids[b, t + 1]`
    (labels there; loss mask 0 on each row's last position, on prompt / tool-output tokens and on
    padding). `fused` (default): `policy_loss_from_hidden` on the output layer's input and weight, so
    the step never builds [T, V] logits; `fused=False`: `policy_loss` on the flattened logits (the same
    update to rounding, at the logits' memory).
    """
    from mixfleet.runner.corrections import policy_loss, policy_loss_from_hidden

    get = correction or _batch_correction
    if fused:
        def hidden_loss(hidden: torch.Tensor, weight: torch.Tensor,
                        batch: Mapping[str, Any]) -> tuple[torch.Tensor, Mapping[str, Any]]:
            return policy_loss_from_hidden(hidden, weight, get(batch), config)

        return OutputLayerLoss(hidden_loss)

    def loss_fn(logits: torch.Tensor, batch: Mapping[str, Any]) -> tuple[torch.Tensor, Mapping[str, Any]]:
        return policy_loss(logits.reshape(-1, logits.shape[-1]), get(batch), config)

    return loss_fn


def spec_from_hf_config(cfg: HFConfig, name: str = "checkpoint") -> ModelSpec:
    """The ModelSpec a Hugging Face layout config describes (any of the layouts of hf_checkpoint)."""
    return cfg.to_spec(name)


def _same_architecture(a: ModelSpec, b: ModelSpec) -> bool:
    keys = ("kind", "num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
            "ffn_hidden_size", "vocab_size", "max_context", "position_embedding", "norm", "norm_eps",
            "activation", "tie_embeddings", "rope_theta", "qk_norm", "moe")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def packed_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] segment ids -> [B, 1, S, S] bool, True = masked (Megatron's convention): causal, same segment."""
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return ~(same & causal)[:, None]


def packed_position_ids(segment_ids: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 where the segment id changes along each row."""
    b, s = segment_ids.shape
    idx = torch.arange(s, device=segment_ids.device).expand(b, s)
    start = torch.ones_like(segment_ids, dtype=torch.bool)
    start[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def _fsync_dir_files(path: Path) -> None:
    for f in path.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


class Trainer:
    """Megatron-core GPTModel + AdamW: logits, one optimizer step per update, HF export, resumable state."""

    def __init__(self, spec: ModelSpec, config: TrainerConfig | None = None, *,
                 init_from: str | Path | None = None, tokenizer: ByteTokenizer | None = None) -> None:
        """Build the spec's model (seeded init), or load its weights from an HF layout checkpoint `init_from`."""
        self.config = config or TrainerConfig()
        self.spec = spec
        self._built: BuiltModel = build_gpt_model(spec, self.config.build)
        self.model = self._built.model
        self._routers = moe_routers(self.model)
        self.last_routing: torch.Tensor | None = None   # MoE: the trainer's experts [B, S, L, k] of the last forward
        self.device = self._built.device
        self.padded_vocab_size = self._built.padded_vocab_size
        self.version = 0
        if tokenizer is None and spec.vocab_size == ByteTokenizer().vocab_size:
            tokenizer = ByteTokenizer()
        self.tokenizer = tokenizer
        if init_from is not None:
            self.load_hf(init_from)
        self.optimizer = self._make_optimizer()

    # ---- construction helpers ----------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, directory: str | Path, config: TrainerConfig | None = None) -> Trainer:
        """A trainer whose architecture and weights come from an HF layout checkpoint (e.g. init-model)."""
        directory = Path(directory)
        spec = spec_from_hf_config(load_config(directory), name=directory.name)
        tok = ByteTokenizer.load(directory) if (directory / TOKENIZER_FILE).exists() else None
        return cls(spec, config, init_from=directory, tokenizer=tok)

    @classmethod
    def resume(cls, state_dir: str | Path, optimizer: Mapping[str, Any] | None = None) -> Trainer:
        """A trainer rebuilt from a `save_state` folder (spec + config + weights + optimizer state + RNG).
        `optimizer`: the run's optimizer settings (lr, grad_clip_norm, warmup_steps), over the saved ones: a resumed
        run trains with its plan's settings (the same as the saved run's unless it took new ones), not silently
        with the values the state was saved with."""
        meta = _read_meta(Path(state_dir))
        spec = model_spec_from_dict(meta["spec"], where=f"{state_dir}/{META_FILE}")
        config = TrainerConfig.from_dict(meta["config"])
        if optimizer:
            opt = {**asdict(config.optimizer), **dict(optimizer)}
            opt["betas"] = tuple(opt["betas"])
            config = replace(config, optimizer=OptimizerConfig(**opt))
        trainer = cls(spec, config)
        trainer.load_state(state_dir)
        return trainer

    def _make_optimizer(self) -> torch.optim.Optimizer:
        o = self.config.optimizer
        decay = [p for _, p in self.model.named_parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for _, p in self.model.named_parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, foreach=False)

    # ---- forward ---------------------------------------------------------------------------
    def _run_model(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                   segment_ids: torch.Tensor | None, routed_experts: torch.Tensor | None,
                   *, output_layer: bool = True) -> torch.Tensor:
        """The GPTModel's output: logits [B, S, padded V], or without its output layer the decoder's final
        hidden states [S, B, H] (Megatron's layout)."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        if s > self.spec.max_context:
            raise ValueError(f"sequence length {s} > max_context {self.spec.max_context} of model '{self.spec.name}'")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.spec.vocab_size):
            raise ValueError(f"input_ids outside the vocabulary [0, {self.spec.vocab_size})")
        dev = torch.device(self.device)
        input_ids = input_ids.to(dev, torch.long)
        mask = None
        if segment_ids is not None:
            if tuple(segment_ids.shape) != (b, s):
                raise ValueError(f"segment_ids shape {tuple(segment_ids.shape)} != input_ids shape {(b, s)}")
            segment_ids = segment_ids.to(dev)
            mask = packed_attention_mask(segment_ids)
            if position_ids is None:
                position_ids = packed_position_ids(segment_ids)
        if position_ids is None:
            position_ids = torch.arange(s, device=dev).expand(b, s)
        position_ids = position_ids.to(dev, torch.long)
        if self._routers:
            if routed_experts is not None:
                routed_experts = routed_experts.reshape(b, s, *routed_experts.shape[-2:])
            routing.arm(self._routers, self.config.routing, routed_experts)
        dt = self._built.autocast_dtype
        try:
            with (contextlib.nullcontext() if dt is None else torch.autocast(device_type=self.device, dtype=dt),
                  contextlib.nullcontext() if output_layer else without_output_layer(self.model)):
                out = self.model(input_ids, position_ids, mask)
            self.last_routing = routing.recorded(self._routers, b, s)
        finally:
            routing.disarm(self._routers)
        return out

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                 segment_ids: torch.Tensor | None, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        logits = self._run_model(input_ids, position_ids, segment_ids, routed_experts)
        return logits[..., : self.spec.vocab_size].float()

    def _forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                        segment_ids: torch.Tensor | None,
                        routed_experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [B * S, H], weight [vocab_size, H]): the output layer's input and weight, not its output.

        Row b * S + t of hidden is what `_forward`'s logits[b, t] would be computed from; the weight
        is the output layer's (padding rows cut off, as the logits are), so hidden @ weight.T are those
        logits. Under autocast (CUDA) both come in the autocast dtype, as the output layer would use them.
        """
        hidden = self._run_model(input_ids, position_ids, segment_ids, routed_experts, output_layer=False)
        hidden = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1])
        weight = output_layer_weight(self.model)[: self.spec.vocab_size]
        dt = self._built.autocast_dtype
        if dt is not None:
            hidden, weight = hidden.to(dt), weight.to(dt)
        return hidden, weight

    def forward_logits(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                       segment_ids: torch.Tensor | None = None,
                       routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, S, vocab_size] (float32, no grad) of the current weights.

        MoE: `routed_experts` [B, S, L, k] (-1 = none) is replayed when `config.routing` is 'replay';
        the trainer's own experts of this forward are left in `last_routing`."""
        self.model.eval()
        with torch.no_grad():
            return self._forward(input_ids, position_ids, segment_ids, routed_experts)

    def token_logprobs(self, input_ids: torch.Tensor, *, temperature: float = 1.0,
                       position_ids: torch.Tensor | None = None,
                       segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S-1]: log p(input_ids[:, t+1] | input_ids[:, :t+1]) over the full vocabulary, at `temperature`."""
        if not temperature > 0:
            raise ValueError(f"temperature = {temperature!r}; allowed: > 0")
        logits = self.forward_logits(input_ids, position_ids=position_ids, segment_ids=segment_ids)
        logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
        return logp.gather(-1, input_ids[:, 1:].to(logp.device, torch.long)[..., None])[..., 0]

    # ---- training --------------------------------------------------------------------------
    def train_step(self, batch: Mapping[str, Any], loss_fn: LossFn | OutputLayerLoss) -> dict[str, float]:
        """One update: forward, loss_fn(logits, batch), backward, clip, one AdamW step; returns metrics.

        With an `OutputLayerLoss` the model runs without its output layer and the loss gets
        (hidden [B * S, H], output weight [vocab_size, H], batch) instead of the logits.

        Metrics: loss, grad_norm (before clipping), lr, version (after the step), skipped (1 if the
        gradient was not finite), step_s, tokens, plus every metric loss_fn returned (as floats).
        MoE with the sampler's experts in the batch (`routed_experts` [B * S, L, k], aligned with the loss
        positions; replayed when `config.routing` is 'replay'): the routing disagreement of routing.py over
        the loss-mask tokens, overall and per `group_ids` ('group/<id>/routing_token_share', ...).
        """
        if "input_ids" not in batch:
            raise ValueError(f"batch has no 'input_ids' (keys: {sorted(batch)})")
        t0 = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sampler_experts = batch.get("routed_experts") if self._routers else None
        inputs = (batch["input_ids"], batch.get("position_ids"), batch.get("segment_ids"), sampler_experts)
        if isinstance(loss_fn, OutputLayerLoss):     # the output layer fused into the loss: no [B, S, V] logits
            loss, loss_metrics = loss_fn(*self._forward_hidden(*inputs), batch)
        else:
            loss, loss_metrics = loss_fn(self._forward(*inputs), batch)
        if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
            raise ValueError("loss_fn must return (scalar loss tensor, metrics mapping)")
        loss.backward()
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.config.optimizer.grad_clip_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        grad_norm_f = float(grad_norm)
        lr = self.config.optimizer.lr_at(self.version)
        skipped = not math.isfinite(grad_norm_f)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {"loss": float(loss.detach()), "grad_norm": grad_norm_f, "lr": lr,
                                     "version": float(self.version), "skipped": float(skipped),
                                     "tokens": float(batch["input_ids"].numel())}
        if sampler_experts is not None and self.last_routing is not None and "loss_mask" in batch:
            n_layers, k_top = self.last_routing.shape[-2:]
            metrics.update(routing.disagreement(
                self.last_routing.reshape(-1, n_layers, k_top), sampler_experts.reshape(-1, n_layers, k_top),
                batch["loss_mask"].reshape(-1), batch.get("group_ids")))
        for k, v in dict(loss_metrics).items():
            if k not in metrics:
                metrics[k] = float(v.detach()) if isinstance(v, torch.Tensor) and v.numel() == 1 else v
        metrics["step_s"] = time.perf_counter() - t0
        return metrics

    # ---- Hugging Face layout ---------------------------------------------------------------
    def hf_config(self, version: int | str | None = None) -> HFConfig:
        v = self.version if version is None else version
        return HFConfig.from_spec(self.spec, weight_version=str(v), torch_dtype=self.config.export_dtype)

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The current weights as HF layout tensors (fresh CPU float32 copies)."""
        tensors = megatron_to_hf(self.model.state_dict(), self.hf_config())
        return {k: v.to("cpu", torch.float32) for k, v in tensors.items()}

    def export_hf(self, directory: str | Path, version: int | str | None = None) -> Path:
        """Write the weights (+ tokenizer) in the HF layout, atomically; weight version = `version` or self.version."""
        try:
            return save_checkpoint(directory, self.hf_config(version), self.hf_state(), tokenizer=self.tokenizer)
        except NonFiniteWeightsError as e:   # a diverged step: never hand it to the samplers
            v = self.version if version is None else version
            raise NonFiniteWeightsError(f"trainer: the weights of version {v} are not finite, not exported ({e}); "
                                        "the last saved trainer state is untouched: resume from it (a lower "
                                        "learning rate or grad_clip_norm may help)") from None

    def load_hf(self, directory: str | Path) -> None:
        """Replace the weights by an HF layout checkpoint of the same architecture (optimizer state untouched)."""
        cfg, tensors = load_checkpoint(directory)
        theirs = spec_from_hf_config(cfg, name=self.spec.name)
        if not _same_architecture(theirs, self.spec):
            raise ValueError(f"{directory}: checkpoint architecture {theirs} does not match model '{self.spec.name}'")
        keys = self.model.state_dict().keys()
        state = hf_to_megatron(tensors, cfg, padded_vocab_size=self.padded_vocab_size,
                               fused_norms=uses_fused_norms(keys), grouped_experts=uses_grouped_experts(keys))
        dev = torch.device(self.device)
        load_into_model(self.model, {k: v.to(dev, torch.float32) for k, v in state.items()})
        self.version = int(cfg.weight_version) if cfg.weight_version.isdigit() else 0

    # ---- resumable state -------------------------------------------------------------------
    def save_state(self, directory: str | Path) -> Path:
        """Model + optimizer + version + RNG states into `directory`, atomically (temp folder, then rename)."""
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                                   "numpy": np.random.get_state()}
            if torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state_all()
            payload = {"format": STATE_FORMAT, "model": self.model.state_dict(),
                       "optimizer": self.optimizer.state_dict(), "version": self.version, "rng": rng}
            torch.save(payload, tmp / STATE_FILE)
            meta = {"format": STATE_FORMAT, "version": self.version, "spec": self.spec.to_dict(),
                    "config": self.config.to_dict()}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            _fsync_dir_files(tmp)
            replace_dir_atomically(tmp, directory)
        except BaseException as e:
            full = _filesystem_full(tmp)            # measured before the cut file is removed
            shutil.rmtree(tmp, ignore_errors=True)
            if full and isinstance(e, Exception) and not isinstance(e, OSError):
                # torch's writer says only "unexpected pos ..." / "file write failed": name the cause
                raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} writing {tmp / STATE_FILE} "
                                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
            raise
        return directory

    def load_state(self, directory: str | Path) -> None:
        """Restore a `save_state` folder written by a trainer of the same architecture."""
        directory = Path(directory)
        meta = _read_meta(directory)
        theirs = model_spec_from_dict(meta["spec"], where=f"{directory}/{META_FILE}")
        if not _same_architecture(theirs, self.spec):
            raise ValueError(f"{directory}: saved model '{theirs.name}' does not match this trainer's "
                             f"'{self.spec.name}' architecture")
        with open(directory / STATE_FILE, "rb") as fh:
            data = fh.read()
        try:   # tensors and plain values only: unpickling a foreign run folder's file must not run its code
            payload = torch.load(io.BytesIO(data), map_location=self.device, weights_only=True)
        except pickle.UnpicklingError as e:
            raise ValueError(f"{directory}/{STATE_FILE}: not a trainer state of tensors and plain values (refused: "
                             f"{str(e).splitlines()[0][:200]})") from None
        except (RuntimeError, EOFError) as e:      # a cut or corrupt file: torch's zip reader
            raise ValueError(f"{directory}/{STATE_FILE}: cut or corrupt ({str(e).splitlines()[0][:160]}); restore "
                             "it, or start over with --force") from None
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.version = int(payload["version"])
        rng = payload["rng"]
        torch.set_rng_state(rng["torch"].cpu())
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])


def _filesystem_full(path: Path) -> bool:
    """Has the filesystem holding `path` (nearly) no room left? (under 4 MiB: a write just failed for want of it)"""
    try:
        return shutil.disk_usage(path).free < 4 << 20
    except OSError:
        return False


def _read_meta(directory: Path) -> dict[str, Any]:
    for name in (META_FILE, STATE_FILE):
        if not (directory / name).exists():
            raise FileNotFoundError(f"{directory}: no {name} (not a trainer state folder written by save_state)")
    meta = json.loads((directory / META_FILE).read_text())
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"{directory}/{META_FILE}: format {meta.get('format')!r}; allowed: {STATE_FORMAT}")
    return meta
