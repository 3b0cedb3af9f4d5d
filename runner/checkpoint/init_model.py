"""A seeded, randomly initialized checkpoint of a model spec (Hugging Face layout + the byte tokenizer).

The quickest way to get a sampler to serve (`mixfleet init-model tiny -o DIR`), for tests and users.
The init is chosen so that a random model is a *useful* test object, not a flat one:

- linear weights N(0, 1/fan_in) (variance-preserving), with the two residual outputs (o_proj,
  down_proj) further scaled by 1/sqrt(2 * layers) so the residual stream stays O(1);
- the MoE router (`mlp.gate`) N(0, 1/hidden) like any linear: router logits ~N(0, 1) per expert, so the
  top-k choice is clear for most tokens yet flips under a precision's error for some (a useful routing test);
- token and position embeddings N(0, 1) and N(0, 0.25); norm weights (also q_norm / k_norm) 1;
- lm_head N(0, (logit_scale / sqrt(hidden))^2): after the final RMSNorm the logits have standard
  deviation ~`logit_scale` (default 4), so next-token distributions are peaked like a trained
  model's rather than near-uniform (with the usual std 0.02 the logits of the tiny model would be
  ~0.3 wide and every precision would look equally harmless).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from mixfleet.costmodel.specs.model import ModelSpec
from mixfleet.runner.checkpoint.hf_checkpoint import HFConfig, expected_shapes, save_checkpoint
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer

DEFAULT_LOGIT_SCALE = 4.0


def init_tensors(cfg: HFConfig, *, seed: int = 0, logit_scale: float = DEFAULT_LOGIT_SCALE) -> dict[str, torch.Tensor]:
    """The random tensors of a checkpoint of `cfg` (fp32, CPU), from one seeded generator."""
    if not logit_scale > 0:
        raise ValueError(f"logit_scale = {logit_scale!r}; allowed: a number > 0")
    g = torch.Generator().manual_seed(seed)
    out_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(cfg).items():          # a fixed order: seeded results are stable
        if name.endswith("norm.weight"):                     # layer norms, q_norm / k_norm, the final norm
            tensors[name] = torch.ones(shape)
            continue
        if name == "model.embed_tokens.weight":
            std = 1.0
        elif name == "model.embed_positions.weight":
            std = 0.5
        elif name == "lm_head.weight":
            std = logit_scale / math.sqrt(cfg.hidden_size)
        else:
            std = 1.0 / math.sqrt(shape[1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= out_scale
        tensors[name] = torch.randn(shape, generator=g) * std
    return tensors


def init_model(spec: ModelSpec, out_dir: str | Path, *, seed: int = 0, logit_scale: float = DEFAULT_LOGIT_SCALE,
               weight_version: str = "0") -> Path:
    """Write a seeded random checkpoint of `spec` (layout: HFConfig.from_spec) with its tokenizer into `out_dir`."""
    cfg = HFConfig.from_spec(spec, weight_version=weight_version)
    tok = ByteTokenizer()
    if cfg.vocab_size < tok.vocab_size:
        raise ValueError(f"model '{spec.name}': vocab_size {cfg.vocab_size} is smaller than the shipped "
                         f"tokenizer's {tok.vocab_size}")
    return save_checkpoint(out_dir, cfg, init_tensors(cfg, seed=seed, logit_scale=logit_scale), tokenizer=tok)
