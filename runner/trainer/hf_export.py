"""Megatron-core GPTModel state dict <-> the Hugging Face layout of `runner/checkpoint/hf_checkpoint.py`.

Why: the trainer trains a Megatron `GPTModel`; every sampler (embedded engine, SGLang) loads the
Llama-style layout. This module is the one place that knows how the two differ, in pure torch (no
Megatron import), so it can be checked against a reference forward pass:

- Fused QKV. Megatron's `linear_qkv.weight` is `[kv_heads * (q_per_group + 2) * d, hidden]`,
  interleaved **per query group**: for group g, its `q_per_group` query heads, then its key head,
  then its value head (`q1 q2 k1 v1 | q3 q4 k2 v2 | ...`). Query head j belongs to group
  j // q_per_group, which is exactly the GQA rule of the HF layout.
- Fused gate/up. `linear_fc1.weight` is `[2 * ffn, hidden]`: rows `[:ffn]` are the gate (silu
  side), rows `[ffn:]` the up projection (Megatron's glu: `silu(chunk0) * chunk1`).
- Vocabulary padding. Megatron pads the vocabulary to a multiple of `make_vocab_size_divisible_by`;
  the export keeps the first `vocab_size` rows of the embedding and of the output layer; the import
  pads with zero rows.
- QK norm (qwen3, qwen3_moe). Megatron's `self_attention.q_layernorm.weight` / `k_layernorm.weight`
  [head_dim] are HF's `self_attn.q_norm.weight` / `k_norm.weight` (one RMSNorm shared by every head).
- MoE (qwen3_moe). The router `mlp.router.weight` [experts, hidden] is HF's `mlp.gate.weight`. Expert e:
  local spec (`SequentialMLP`) `mlp.experts.local_experts.{e}.linear_fc1.weight` [2 * moe_ffn, hidden]
  (gate rows then up rows, as the dense fc1) and `...linear_fc2.weight`; Transformer Engine's grouped
  experts (`TEGroupedMLP`) `mlp.experts.linear_fc1.weight{e}` / `mlp.experts.linear_fc2.weight{e}`.
  HF: `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj` (one key per expert, as the published
  Qwen3-MoE checkpoints). The MoE layer's norm is `pre_mlp_layernorm` in both Megatron specs.
- Norms. The local spec names them `input_layernorm` / `pre_mlp_layernorm`; the Transformer Engine
  spec fuses them into `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`. Both are read;
  the import writes the layout the target model uses (`fused_norms`).
- `*._extra_state` entries (Transformer Engine's FP8 metadata; None in the local spec) carry no
  weights and are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from mixfleet.runner.checkpoint.hf_checkpoint import HFConfig, check_layout, expected_shapes

_EXTRA = "._extra_state"


def split_qkv(w: torch.Tensor, *, heads: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    """Megatron fused QKV weight -> (q [heads*d, h], k [kv*d, h], v [kv*d, h]), per-group interleave undone."""
    qpg = heads // kv_heads
    if w.shape[0] != kv_heads * (qpg + 2) * head_dim:
        raise ValueError(f"linear_qkv rows {w.shape[0]} != kv_heads * (heads/kv_heads + 2) * head_dim "
                         f"= {kv_heads * (qpg + 2) * head_dim}")
    g = w.reshape(kv_heads, qpg + 2, head_dim, w.shape[-1])
    q = g[:, :qpg].reshape(heads * head_dim, -1).clone()
    k = g[:, qpg].reshape(kv_heads * head_dim, -1).clone()
    v = g[:, qpg + 1].reshape(kv_heads * head_dim, -1).clone()
    return q, k, v


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, heads: int, kv_heads: int,
             head_dim: int) -> torch.Tensor:
    """Inverse of `split_qkv`."""
    qpg = heads // kv_heads
    hidden = q.shape[-1]
    parts = (q.reshape(kv_heads, qpg, head_dim, hidden), k.reshape(kv_heads, 1, head_dim, hidden),
             v.reshape(kv_heads, 1, head_dim, hidden))
    return torch.cat(parts, dim=1).reshape(kv_heads * (qpg + 2) * head_dim, hidden)


def _norm_names(i: int, fused: bool, moe: bool) -> tuple[str, str]:
    """(attention norm, MLP norm) names; TE fuses both into the next linear, except the MoE layer's norm."""
    p = f"decoder.layers.{i}."
    attn = p + "self_attention.linear_qkv.layer_norm_weight" if fused else p + "input_layernorm.weight"
    mlp = p + "mlp.linear_fc1.layer_norm_weight" if fused and not moe else p + "pre_mlp_layernorm.weight"
    return attn, mlp


def _expert_names(p: str, e: int, grouped: bool) -> tuple[str, str]:
    if grouped:                                   # Transformer Engine's TEGroupedMLP
        return p + f"mlp.experts.linear_fc1.weight{e}", p + f"mlp.experts.linear_fc2.weight{e}"
    local = p + f"mlp.experts.local_experts.{e}."
    return local + "linear_fc1.weight", local + "linear_fc2.weight"


def _split_glu(fc1: torch.Tensor, ffn: int, name: str, out: dict[str, torch.Tensor], hp: str) -> None:
    """Megatron's fused [gate; up] fc1 -> HF gate_proj / up_proj under the prefix hp."""
    if fc1.shape[0] != 2 * ffn:
        raise ValueError(f"{name} has {fc1.shape[0]} rows, expected 2 * ffn = {2 * ffn}")
    out[hp + "gate_proj.weight"] = fc1[:ffn].clone()
    out[hp + "up_proj.weight"] = fc1[ffn:].clone()


def megatron_to_hf(state: Mapping[str, torch.Tensor], cfg: HFConfig) -> dict[str, torch.Tensor]:
    """A GPTModel state dict (local or TE spec; dense or MoE) -> the HF layout tensors (fresh, detached copies).

    Every Megatron weight must be consumed: an unexpected name is an error, not silently dropped.
    """
    weights = {k: v for k, v in state.items() if not k.endswith(_EXTRA)}
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(f"Megatron state dict has no {name!r} (got e.g. {sorted(weights)[:4]})")
        used.add(name)
        return weights[name].detach()

    vocab, d = cfg.vocab_size, cfg.head_dim
    fused = uses_fused_norms(weights)
    out: dict[str, torch.Tensor] = {}
    emb = take("embedding.word_embeddings.weight")
    if emb.shape[0] < vocab:
        raise ValueError(f"embedding has {emb.shape[0]} rows < vocab_size {vocab}")
    out["model.embed_tokens.weight"] = emb[:vocab].clone()
    if cfg.position_embedding_type == "learned_absolute":
        out["model.embed_positions.weight"] = take("embedding.position_embeddings.weight").clone()
    for i in range(cfg.num_hidden_layers):
        p, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
        n_attn, n_mlp = _norm_names(i, fused, cfg.is_moe)
        out[hp + "input_layernorm.weight"] = take(n_attn).clone()
        out[hp + "post_attention_layernorm.weight"] = take(n_mlp).clone()
        q, k, v = split_qkv(take(p + "self_attention.linear_qkv.weight"), heads=cfg.num_attention_heads,
                            kv_heads=cfg.num_key_value_heads, head_dim=d)
        out[hp + "self_attn.q_proj.weight"], out[hp + "self_attn.k_proj.weight"] = q, k
        out[hp + "self_attn.v_proj.weight"] = v
        out[hp + "self_attn.o_proj.weight"] = take(p + "self_attention.linear_proj.weight").clone()
        if cfg.qk_norm:
            out[hp + "self_attn.q_norm.weight"] = take(p + "self_attention.q_layernorm.weight").clone()
            out[hp + "self_attn.k_norm.weight"] = take(p + "self_attention.k_layernorm.weight").clone()
        if cfg.is_moe:
            out[hp + "mlp.gate.weight"] = take(p + "mlp.router.weight").clone()
            grouped = (p + "mlp.experts.linear_fc1.weight0") in weights
            for e in range(cfg.num_experts):
                fc1_name, fc2_name = _expert_names(p, e, grouped)
                _split_glu(take(fc1_name), cfg.moe_intermediate_size, fc1_name, out, hp + f"mlp.experts.{e}.")
                out[hp + f"mlp.experts.{e}.down_proj.weight"] = take(fc2_name).clone()
        else:
            _split_glu(take(p + "mlp.linear_fc1.weight"), cfg.intermediate_size, p + "mlp.linear_fc1.weight", out,
                       hp + "mlp.")
            out[hp + "mlp.down_proj.weight"] = take(p + "mlp.linear_fc2.weight").clone()
    out["model.norm.weight"] = take("decoder.final_layernorm.weight").clone()
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("output_layer.weight")[:vocab].clone()
    unused = sorted(set(weights) - used)
    if unused:
        raise ValueError(f"Megatron weights not in the HF layout {cfg.model_type!r} (another spec?): {unused[:5]}")
    shapes = expected_shapes(cfg)
    for name, t in out.items():
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"export: {name} has shape {tuple(t.shape)}, the layout wants {shapes[name]}")
    return out


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] > rows:
        raise ValueError(f"{t.shape[0]} rows do not fit a padded vocabulary of {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t.clone()


def hf_to_megatron(tensors: Mapping[str, torch.Tensor], cfg: HFConfig, *, padded_vocab_size: int,
                   fused_norms: bool = False, grouped_experts: bool = False) -> dict[str, torch.Tensor]:
    """HF layout tensors -> a GPTModel state dict (vocabulary zero-padded to padded_vocab_size); the target
    model's naming: `fused_norms` (TE dense spec), `grouped_experts` (TE grouped-GEMM experts)."""
    check_layout(cfg, tensors, "HF tensors")
    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight":
                                    _pad_rows(tensors["model.embed_tokens.weight"], padded_vocab_size)}
    if cfg.position_embedding_type == "learned_absolute":
        out["embedding.position_embeddings.weight"] = tensors["model.embed_positions.weight"].clone()
    for i in range(cfg.num_hidden_layers):
        p, hp = f"decoder.layers.{i}.", f"model.layers.{i}."
        n_attn, n_mlp = _norm_names(i, fused_norms, cfg.is_moe)
        out[n_attn] = tensors[hp + "input_layernorm.weight"].clone()
        out[n_mlp] = tensors[hp + "post_attention_layernorm.weight"].clone()
        out[p + "self_attention.linear_qkv.weight"] = fuse_qkv(
            tensors[hp + "self_attn.q_proj.weight"], tensors[hp + "self_attn.k_proj.weight"],
            tensors[hp + "self_attn.v_proj.weight"], heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
        out[p + "self_attention.linear_proj.weight"] = tensors[hp + "self_attn.o_proj.weight"].clone()
        if cfg.qk_norm:
            out[p + "self_attention.q_layernorm.weight"] = tensors[hp + "self_attn.q_norm.weight"].clone()
            out[p + "self_attention.k_layernorm.weight"] = tensors[hp + "self_attn.k_norm.weight"].clone()
        if cfg.is_moe:
            out[p + "mlp.router.weight"] = tensors[hp + "mlp.gate.weight"].clone()
            for e in range(cfg.num_experts):
                fc1_name, fc2_name = _expert_names(p, e, grouped_experts)
                he = hp + f"mlp.experts.{e}."
                out[fc1_name] = torch.cat([tensors[he + "gate_proj.weight"], tensors[he + "up_proj.weight"]])
                out[fc2_name] = tensors[he + "down_proj.weight"].clone()
        else:
            out[p + "mlp.linear_fc1.weight"] = torch.cat([tensors[hp + "mlp.gate_proj.weight"],
                                                          tensors[hp + "mlp.up_proj.weight"]])
            out[p + "mlp.linear_fc2.weight"] = tensors[hp + "mlp.down_proj.weight"].clone()
    out["decoder.final_layernorm.weight"] = tensors["model.norm.weight"].clone()
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(tensors["lm_head.weight"], padded_vocab_size)
    return out


def load_into_model(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a converted state into a GPTModel; only `_extra_state` entries may be left unset."""
    result = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(_EXTRA)]
    if missing or result.unexpected_keys:
        raise ValueError(f"state does not fit the model: missing {missing[:5]}, "
                         f"unexpected {list(result.unexpected_keys)[:5]}")


def uses_fused_norms(keys: Iterable[str]) -> bool:
    """True when a model's state dict names its norms the Transformer Engine way."""
    return any(k.endswith("linear_qkv.layer_norm_weight") for k in keys)


def uses_grouped_experts(keys: Iterable[str]) -> bool:
    """True when a model's state dict names its experts the Transformer Engine grouped-GEMM way."""
    return any(k.endswith("mlp.experts.linear_fc1.weight0") for k in keys)
