"""Core attention for Megatron-core's local layer spec, written on torch's scaled_dot_product_attention.

Why: Megatron-core's own local `DotProductAttention` (and its fused softmax) calls `torch.cuda` and
fails on a CPU-only torch. The layer-spec mechanism lets us swap in this module as
`self_attention.submodules.core_attention` without touching torch or Megatron.

Contract (what Megatron's `SelfAttention` hands a core-attention module):
query `[s, b, heads, d]`, key / value `[s, b, kv_heads, d]` (GQA: query head j uses KV head
j // (heads / kv_heads), the grouping of Megatron's fused QKV), optional `attention_mask`
`[b or 1, 1, s, s]` boolean with **True = masked out** (Megatron's convention). Output `[s, b, heads * d]`.
Without a mask the attention is causal; with one, the mask is used as given (the trainer builds
causal + same-segment masks for packed rows). Scale: `softmax_scale` or 1/sqrt(d).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPACoreAttention(MegatronModule):
    """Causal GQA attention on `torch.nn.functional.scaled_dot_product_attention` (no dropout)."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPACoreAttention: attn_mask_type {attn_mask_type!r} not supported; "
                             "allowed: causal, padding_causal")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"SDPACoreAttention: attention_dropout = {dropout}; allowed: 0.0 (RL trainer)")
        if config.context_parallel_size != 1:
            raise ValueError(f"SDPACoreAttention: context_parallel_size = {config.context_parallel_size}; allowed: 1")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("SDPACoreAttention: packed_seq_params (thd format) not supported; "
                             "pack rows with an attention mask (segment ids) instead")
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention: attention_bias not supported")
        s, b, heads, d = query.shape
        kv_heads = key.shape[2]
        if heads % kv_heads:
            raise ValueError(f"SDPACoreAttention: {heads} query heads not a multiple of {kv_heads} KV heads")
        q = query.permute(1, 2, 0, 3)          # [b, heads, s, d]
        k = key.permute(1, 2, 0, 3)            # [b, kv_heads, s, d]
        v = value.permute(1, 2, 0, 3)
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(d)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=kv_heads != heads)
        else:
            keep = ~attention_mask.to(torch.bool)   # SDPA: True = attend
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=kv_heads != heads)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)
