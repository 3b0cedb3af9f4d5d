"""The Hugging Face layout checkpoints that every sampler loads and the trainer exports.

A checkpoint is a folder: `config.json` + `model.safetensors` (+ `tokenizer.json`). Three layouts, told apart
by `config.json`'s `model_type`:

- `qwen3` (Hugging Face's Qwen3ForCausalLM): RoPE, GQA, per-head QK RMSNorm, SwiGLU MLP.
- `qwen3_moe` (Qwen3MoeForCausalLM): the same attention; every layer a top-k routed MoE (softmax router over
  `num_experts`, top `num_experts_per_tok`, renormalized when `norm_topk_prob`; no shared experts).
- `mixfleet` (the original tiny): the Llama names, no QK norm, learned absolute positions (or RoPE).

Tensor names (no biases); the MoE experts are stored one key per expert, as the published Qwen3-MoE
checkpoints and SGLang's loader have them (transformers 5 fuses them into `mlp.experts.gate_up_proj` /
`down_proj` at load time through its conversion mapping for `qwen3_moe`, and splits them again on save):

    model.embed_tokens.weight                        [vocab, hidden]
    model.embed_positions.weight                     [max_context, hidden]   (mixfleet, learned_absolute only)
    model.layers.{i}.input_layernorm.weight          [hidden]
    model.layers.{i}.self_attn.q_proj.weight         [heads * head_dim, hidden]
    model.layers.{i}.self_attn.k_proj.weight         [kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.v_proj.weight         [kv_heads * head_dim, hidden]
    model.layers.{i}.self_attn.o_proj.weight         [hidden, heads * head_dim]
    model.layers.{i}.self_attn.q_norm.weight         [head_dim]                (qwen3, qwen3_moe)
    model.layers.{i}.self_attn.k_norm.weight         [head_dim]                (qwen3, qwen3_moe)
    model.layers.{i}.post_attention_layernorm.weight [hidden]
    model.layers.{i}.mlp.gate_proj.weight            [ffn, hidden]             (dense)
    model.layers.{i}.mlp.up_proj.weight              [ffn, hidden]             (dense)
    model.layers.{i}.mlp.down_proj.weight            [hidden, ffn]             (dense)
    model.layers.{i}.mlp.gate.weight                 [experts, hidden]         (qwen3_moe: the router)
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight [moe_ffn, hidden]        (qwen3_moe, e < experts)
    model.layers.{i}.mlp.experts.{e}.up_proj.weight   [moe_ffn, hidden]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight [hidden, moe_ffn]
    model.norm.weight                                [hidden]
    lm_head.weight                                   [vocab, hidden]          (absent if tied)

The forward pass these weights define (engine and trainer both implement it; HF transformers' Qwen3 classes
are the independent reference): x = embed_tokens[ids] (+ embed_positions[pos]); per layer:
h = x + o_proj(attn(rmsnorm(x))); x = h + ffn(rmsnorm(h)). RMSNorm: `w * x / sqrt(mean(x^2) + eps)`.
Attention: q, k, v projections; with QK norm, RMSNorm over head_dim of each query and key head (weights
q_norm / k_norm, eps rms_norm_eps) *before* RoPE (rotate-half, `rope_theta`); causal, GQA (query head j uses
KV head j // (heads / kv_heads)), scale 1/sqrt(head_dim). Dense ffn: down(silu(gate(n)) * up(n)). MoE ffn:
p = softmax(gate(n)) over experts (fp32), the top-k experts by p (ties: the lower index), weights p_topk
(/ sum p_topk when norm_topk_prob); ffn(n) = sum_k w_k * expert_k(n), each expert a SwiGLU.
logits = lm_head(rmsnorm(x)).

`config.json` carries HF's own keys for the layout (model_type, architectures, rope_theta, num_experts, ...),
plus `mixfleet_weight_version` (the trainer version that wrote the weights; HF ignores unknown keys).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from mixfleet.costmodel.specs.model import ModelSpec, MoESpec
from safetensors.torch import load_file, save_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


MODEL_TYPES = ("mixfleet", "qwen3", "qwen3_moe")
_ARCHITECTURES = {"mixfleet": "MixfleetForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True, kw_only=True)
class HFConfig:
    """The architecture as stored in config.json (HF field names of the layout `model_type`)."""

    hidden_size: int
    intermediate_size: int                   # dense SwiGLU width (0 when every layer is MoE)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    position_embedding_type: str = "learned_absolute"   # or "rope" (always "rope" for qwen3 / qwen3_moe)
    model_type: str = "mixfleet"             # "mixfleet" | "qwen3" | "qwen3_moe"
    num_experts: int = 0                     # qwen3_moe: routed experts per layer
    num_experts_per_tok: int = 0             # qwen3_moe: top-k
    moe_intermediate_size: int = 0           # qwen3_moe: SwiGLU width of one expert
    norm_topk_prob: bool = False             # qwen3_moe: renormalize the top-k probabilities
    weight_version: str = "0"
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        where = "config.json"
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"{where}: model_type = {self.model_type!r}; allowed: {', '.join(MODEL_TYPES)}")
        if self.position_embedding_type not in ("learned_absolute", "rope"):
            raise ValueError(f"{where}: position_embedding_type = {self.position_embedding_type!r}; "
                             "allowed: learned_absolute, rope")
        if self.model_type != "mixfleet" and self.position_embedding_type != "rope":
            raise ValueError(f"{where}: model_type {self.model_type!r} needs position_embedding_type 'rope', "
                             f"got {self.position_embedding_type!r}")
        if self.is_moe:
            if not self.num_experts > 0 or not self.moe_intermediate_size > 0:
                raise ValueError(f"{where}: qwen3_moe needs num_experts > 0 and moe_intermediate_size > 0, got "
                                 f"{self.num_experts} and {self.moe_intermediate_size}")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"{where}: num_experts_per_tok = {self.num_experts_per_tok}; allowed: "
                                 f"1..num_experts ({self.num_experts})")
        elif self.num_experts:
            raise ValueError(f"{where}: num_experts = {self.num_experts} with model_type {self.model_type!r}; "
                             "allowed: 0 (experts need model_type 'qwen3_moe')")
        elif not self.intermediate_size > 0:
            raise ValueError(f"{where}: intermediate_size = {self.intermediate_size}; allowed: > 0 (dense MLP)")

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe"

    @property
    def qk_norm(self) -> bool:
        return self.model_type in ("qwen3", "qwen3_moe")

    @classmethod
    def from_spec(cls, spec: ModelSpec, *, weight_version: str = "0", torch_dtype: str = "float32") -> HFConfig:
        """The layout of a spec: kind 'moe' -> qwen3_moe; dense with qk_norm -> qwen3; dense without -> mixfleet."""
        where = f"model '{spec.name}'"
        moe_kw: dict[str, Any] = {}
        if spec.kind == "moe":
            assert spec.moe is not None
            if spec.position_embedding != "rope" or not spec.qk_norm:
                raise ValueError(f"{where}: kind = 'moe' checkpoints use the Qwen3-MoE layout, which needs "
                                 f"position_embedding = 'rope' and qk_norm = true (got "
                                 f"{spec.position_embedding!r}, {spec.qk_norm})")
            if spec.moe.shared_experts:
                raise ValueError(f"{where}: moe.shared_experts = {spec.moe.shared_experts}; allowed: 0 (the "
                                 "Qwen3-MoE layout has no shared experts)")
            if spec.ffn_hidden_size:
                raise ValueError(f"{where}: ffn_hidden_size = {spec.ffn_hidden_size}; allowed: 0 for kind = 'moe' "
                                 "(every layer of the Qwen3-MoE layout is MoE)")
            model_type = "qwen3_moe"
            moe_kw = dict(num_experts=spec.moe.num_experts, num_experts_per_tok=spec.moe.active_experts,
                          moe_intermediate_size=spec.moe.expert_ffn_hidden_size,
                          norm_topk_prob=spec.moe.norm_topk_prob)
        elif spec.qk_norm:
            if spec.position_embedding != "rope":
                raise ValueError(f"{where}: qk_norm = true uses the Qwen3 layout, which needs position_embedding "
                                 f"= 'rope', got {spec.position_embedding!r}")
            model_type = "qwen3"
        else:
            model_type = "mixfleet"
        if spec.norm != "rmsnorm" or spec.activation != "swiglu":
            raise ValueError(f"{where}: norm = {spec.norm!r}, activation = {spec.activation!r}; the checkpoint "
                             "layouts take norm = 'rmsnorm', activation = 'swiglu'")
        return cls(hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
                   num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_attention_heads,
                   num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab_size=spec.vocab_size,
                   max_position_embeddings=spec.max_context, rms_norm_eps=spec.norm_eps,
                   rope_theta=float(spec.rope_theta), tie_word_embeddings=spec.tie_embeddings,
                   position_embedding_type=spec.position_embedding, model_type=model_type,
                   weight_version=weight_version, torch_dtype=torch_dtype, **moe_kw)

    def to_spec(self, name: str = "checkpoint") -> ModelSpec:
        """The ModelSpec this config describes (the inverse of from_spec)."""
        moe = None
        if self.is_moe:
            moe = MoESpec(num_experts=self.num_experts, active_experts=self.num_experts_per_tok,
                          expert_ffn_hidden_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob)
        return ModelSpec(name=name, kind="moe" if self.is_moe else "dense", num_layers=self.num_hidden_layers,
                         hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                         num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
                         ffn_hidden_size=self.intermediate_size, vocab_size=self.vocab_size,
                         max_context=self.max_position_embeddings, position_embedding=self.position_embedding_type,
                         norm_eps=self.rms_norm_eps, tie_embeddings=self.tie_word_embeddings,
                         rope_theta=self.rope_theta, qk_norm=self.qk_norm, moe=moe,
                         source="read from a Hugging Face layout config.json")

    def to_json(self) -> dict[str, Any]:
        common = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps",
                  "rope_theta", "tie_word_embeddings")
        d: dict[str, Any] = {"architectures": [_ARCHITECTURES[self.model_type]], "model_type": self.model_type}
        d.update({k: getattr(self, k) for k in common})
        d["hidden_act"] = "silu"
        if self.model_type == "mixfleet":
            d["position_embedding_type"] = self.position_embedding_type
            d["torch_dtype"] = self.torch_dtype
        else:                     # HF's own keys, as the published Qwen3 / Qwen3-MoE config.json files have them
            d.update(attention_bias=False, attention_dropout=0.0, rope_scaling=None, use_sliding_window=False,
                     sliding_window=None, use_cache=True, dtype=self.torch_dtype)
            if self.is_moe:
                d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                         moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                         decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
            else:
                d["max_window_layers"] = self.num_hidden_layers
        d["mixfleet_weight_version"] = self.weight_version
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HFConfig:
        """Read a config.json of any of the three layouts (also as transformers 5 writes them: `dtype`,
        `rope_parameters`); refuses what the engine cannot run (sliding windows, dense layers among MoE)."""
        model_type = d.get("model_type", "mixfleet")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json: model_type = {model_type!r}; allowed: {', '.join(MODEL_TYPES)}")
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k not in ("weight_version", "model_type")}
        kw["model_type"] = model_type
        kw["weight_version"] = str(d.get("mixfleet_weight_version", "0"))
        if "num_experts" not in d and "num_local_experts" in d:      # transformers 5's save_pretrained name
            kw["num_experts"] = d["num_local_experts"]
        if "torch_dtype" not in d and isinstance(d.get("dtype"), str):
            kw["torch_dtype"] = d["dtype"]
        if model_type != "mixfleet":
            kw["position_embedding_type"] = "rope"
            rope = d.get("rope_parameters") or {}
            if "rope_theta" not in d and "rope_theta" in rope:
                kw["rope_theta"] = rope["rope_theta"]
            scaling = d.get("rope_scaling") or {}
            rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
            if rope_type != "default":
                raise ValueError(f"config.json: rope_type = {rope_type!r}; allowed: default")
            if d.get("use_sliding_window") or d.get("attention_bias"):
                raise ValueError("config.json: use_sliding_window / attention_bias = true; allowed: false")
        if model_type == "qwen3_moe" and (d.get("mlp_only_layers") or d.get("decoder_sparse_step", 1) != 1):
            raise ValueError(f"config.json: mlp_only_layers = {d.get('mlp_only_layers')!r}, decoder_sparse_step = "
                             f"{d.get('decoder_sparse_step')!r}; allowed: [] and 1 (every layer MoE)")
        if model_type == "qwen3_moe" and "intermediate_size" not in kw:
            kw["intermediate_size"] = 0
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
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if cfg.is_moe:
            f = cfg.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
            for e in range(cfg.num_experts):
                shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (f, h)
                shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (f, h)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, f)
        else:
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


class NonFiniteWeightsError(ValueError):
    """A tensor set holds NaN or Inf (a diverged trainer step, a corrupt file): never written nor loaded."""


def check_finite(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """NonFiniteWeightsError naming `where` and the first tensors holding NaN / Inf, with their counts."""
    bad = []
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad.append(f"{name} ({int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} Inf)")
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise NonFiniteWeightsError(f"{where}: non-finite weights in {len(bad)} tensor(s): "
                                    f"{', '.join(bad[:3])}{more}")


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def set_aside_name(directory: Path, pid: int | None = None) -> Path:
    """Where `replace_dir_atomically` puts the old folder between its two renames: `.NAME.old.<pid>`."""
    return directory.with_name(f".{directory.name}.old.{os.getpid() if pid is None else pid}")


def replace_dir_atomically(tmp: Path, directory: Path) -> None:
    """Put the finished folder `tmp` at `directory`, replacing any old one by renames (a reader sees the old
    folder or the new one, never a mix); `tmp` must be beside `directory` (same filesystem).

    Killed between the two renames, it leaves the old folder as `.NAME.old.<pid>` beside no `NAME`:
    `recover_replaced_dir` puts it back."""
    if directory.exists():
        old = set_aside_name(directory)
        if old.exists():                       # ours, left by a killed replace of a process with this pid
            shutil.rmtree(old)
        os.replace(directory, old)
        os.replace(tmp, directory)
        _fsync_dir(directory.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
        _fsync_dir(directory.parent)


_SET_ASIDE = r"\.old\.\d+"
_MKDTEMP = r"\.[a-z0-9_]{8}"            # tempfile.mkdtemp's random part (`save_checkpoint`, `Trainer.save_state`)


def leftovers(directory: Path) -> list[Path]:
    """What killed writers of `directory` left beside it: set-aside old folders (`.NAME.old.<pid>`) and
    unfinished temp folders (`.NAME.<8 random>`, from tempfile.mkdtemp), by name only."""
    pattern = re.compile(rf"^\.{re.escape(directory.name)}(?:{_SET_ASIDE}|{_MKDTEMP})$")
    parent = directory.parent
    if not parent.is_dir():
        return []
    return sorted(p for p in parent.iterdir() if pattern.match(p.name))


def recover_replaced_dir(directory: Path, *, complete: Callable[[Path], bool],
                         fallback: Path | None = None, dry_run: bool = False) -> Path | None:
    """A replace killed between its two renames leaves `.NAME.old.<pid>` beside no `NAME`: rename that old,
    complete folder back. With none, `fallback` (e.g. a staging folder the replace had not moved yet) if it
    is complete. Returns the folder restored from, or None (nothing to do: `directory` exists, or nothing
    complete is there); `dry_run`: only say which. Two complete old folders: a ValueError naming them (which
    one to keep is ambiguous)."""
    if directory.exists() or directory.is_symlink():
        return None
    old = [p for p in leftovers(directory) if re.search(rf"{_SET_ASIDE}$", p.name) and p.is_dir()
           and not p.is_symlink() and complete(p)]
    if len(old) > 1:
        raise ValueError(f"{directory}: missing, and {len(old)} complete old copies of it are beside it "
                         f"({', '.join(p.name for p in old)}); rename the one to keep to {directory.name}")
    src = old[0] if old else (fallback if fallback is not None and fallback.is_dir() and not fallback.is_symlink()
                              and complete(fallback) else None)
    if src is None or dry_run:
        return src
    os.replace(src, directory)
    _fsync_dir(directory.parent)
    return src


def remove_leftovers(directory: Path, *, may_remove: Callable[[Path], bool]) -> list[str]:
    """Delete the `leftovers` of `directory` that `may_remove` accepts (the caller checks their contents are
    its own), once `directory` itself is in place; returns the names removed."""
    if not directory.is_dir():
        return []
    removed = []
    for p in leftovers(directory):
        if not p.is_symlink() and p.is_dir() and may_remove(p):
            shutil.rmtree(p)
            removed.append(p.name)
    return removed


def save_checkpoint(directory: str | Path, cfg: HFConfig, tensors: Mapping[str, torch.Tensor],
                    *, tokenizer: Any | None = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer) atomically: a reader never sees half a checkpoint.

    The folder is written under a temporary name beside `directory` and renamed into place.
    """
    directory = Path(directory)
    check_layout(cfg, tensors, "checkpoint tensors", allow_extra=False)
    check_finite(tensors, "checkpoint tensors")
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
    """Read and check a checkpoint folder; errors say which tensor is missing, misshapen or not finite."""
    cfg = load_config(directory)
    path = Path(directory) / WEIGHTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{directory}: no {WEIGHTS_FILE}")
    tensors = load_file(str(path))
    check_layout(cfg, tensors, str(directory))
    check_finite(tensors, str(directory))
    return cfg, tensors
