"""The Hugging Face layout checkpoint that every sampler loads and the trainer exports.

A checkpoint is a folder: `config.json` + `model.safetensors` (+ `tokenizer.json`). Tensor names
follow the Llama layout (no biases), plus one tensor for learned absolute positions:

    model.embed_tokens.weight                      [vocab, hidden]
    model.embed_positions.weight                   [max_context, hidden]   (learned_absolute only)
    model.layers.{i}.input_layernorm.weight        [hidden]
    model.layers.{i}.self_attn.q_proj.weight       [heads * head_dim, hidden]
    model.layers.{i}.self_attn.k_proj.weight       [kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.v_proj.weight       [kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.o_proj.weight       [hidden, heads * head_dim]
    model.layers.{i}.post_attention_layernorm.weight [hidden]
    model.layers.{i}.mlp.gate_proj.weight          [ffn, hidden]
    model.layers.{i}.mlp.up_proj.weight            [ffn, hidden]
    model.layers.{i}.mlp.down_proj.weight          [hidden, ffn]
    model.norm.weight                              [hidden]
    lm_head.weight                                 [vocab, hidden]          (absent if tied)

The forward pass these weights define (engine and trainer both implement it):
x = embed_tokens[ids] (+ embed_positions[pos]); per layer: h = x + o_proj(attn(rmsnorm(x)));
x = h + down_proj(silu(gate_proj(n)) * up_proj(n)) with n = rmsnorm(h); logits = lm_head(rmsnorm(x)).
RMSNorm: `w * x / sqrt(mean(x^2) + eps)`. Attention: causal, GQA (query head j uses KV head
j // (heads / kv_heads)), scale 1/sqrt(head_dim); RoPE (rotate-half, `rope_theta`) when
position_embedding == "rope".

`config.json` carries the architecture numbers under the Llama names, plus `position_embedding_type`
and `mixfleet_weight_version` (the trainer version that wrote the weights).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from mixfleet.costmodel.model import ModelSpec
from safetensors.torch import load_file, save_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True, kw_only=True)
class HFConfig:
    """The architecture as stored in config.json (Llama field names)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    position_embedding_type: str = "learned_absolute"   # or "rope"
    weight_version: str = "0"
    torch_dtype: str = "float32"

    @classmethod
    def from_spec(cls, spec: ModelSpec, *, weight_version: str = "0", torch_dtype: str = "float32") -> HFConfig:
        if spec.kind != "dense":
            raise ValueError(f"model '{spec.name}': the embedded engine and CPU trainer take dense models "
                             f"(kind = 'dense'); got kind = {spec.kind!r}")
        return cls(hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
                   num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
                   num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab_size=spec.vocab_size,
                   max_position_embeddings=spec.max_context, rms_norm_eps=spec.norm_eps,
                   tie_word_embeddings=spec.tie_embeddings, position_embedding_type=spec.position_embedding,
                   weight_version=weight_version, torch_dtype=torch_dtype)

    def to_json(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "weight_version"}
        d["mixfleet_weight_version"] = self.weight_version
        d["architectures"] = ["MixfleetForCausalLM"]
        d["model_type"] = "mixfleet"
        d["hidden_act"] = "silu"
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HFConfig:
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k != "weight_version"}
        kw["weight_version"] = str(d.get("mixfleet_weight_version", "0"))
        return cls(**kw)


def expected_shapes(cfg: HFConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the layout with its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if cfg.position_embedding_type == "learned_absolute":
        shapes["model.embed_positions.weight"] = (cfg.max_position_embeddings, h)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_attention_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_key_value_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_key_value_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_attention_heads * d)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes


def check_layout(cfg: HFConfig, tensors: Mapping[str, torch.Tensor], where: str, *, allow_extra: bool = True) -> None:
    """ValueError naming `where` and the tensor when `tensors` lack a name of the layout, carry one of the wrong
    shape, or (allow_extra=False) carry a name the layout does not have."""
    shapes = expected_shapes(cfg)
    missing = sorted(set(shapes) - set(tensors))
    extra = [] if allow_extra else sorted(set(tensors) - set(shapes))
    if missing or extra:
        more = " ..." if len(missing) > 5 else ""
        unexpected = f", unexpected {extra[:5]}" if extra else ""
        raise ValueError(f"{where}: missing tensors {missing[:5]}{more}{unexpected}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")


def replace_dir_atomically(tmp: Path, directory: Path) -> None:
    """Put the finished folder `tmp` at `directory`, replacing any old one by renames (a reader sees the old
    folder or the new one, never a mix); `tmp` must be beside `directory` (same filesystem)."""
    if directory.exists():
        old = directory.with_name(f".{directory.name}.old.{os.getpid()}")
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)


def save_checkpoint(directory: str | Path, cfg: HFConfig, tensors: Mapping[str, torch.Tensor],
                    *, tokenizer: Any | None = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer) atomically: a reader never sees half a checkpoint.

    The folder is written under a temporary name beside `directory` and renamed into place.
    """
    directory = Path(directory)
    check_layout(cfg, tensors, "checkpoint tensors", allow_extra=False)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        dtype = getattr(torch, cfg.torch_dtype)
        save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg.to_json(), indent=2) + "\n")
        if tokenizer is not None:
            tokenizer.save(tmp)
        replace_dir_atomically(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def load_config(directory: str | Path) -> HFConfig:
    path = Path(directory) / CONFIG_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory}: no {CONFIG_FILE} (not a Hugging Face layout checkpoint)")
    return HFConfig.from_json(json.loads(path.read_text()))


def load_checkpoint(directory: str | Path) -> tuple[HFConfig, dict[str, torch.Tensor]]:
    """Read and check a checkpoint folder; errors say which tensor is missing or misshapen."""
    cfg = load_config(directory)
    path = Path(directory) / WEIGHTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory}: no {WEIGHTS_FILE}")
    tensors = load_file(str(path))
    check_layout(cfg, tensors, str(directory))
    return cfg, tensors
