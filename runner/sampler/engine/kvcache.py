"""The engine's KV cache: one slot per running request, quantized on write to the group's KV dtype.

Storage is one tensor per K and V of shape [layers, slots, kv_heads, capacity, head_dim] so that a
decode step over the running batch reads one contiguous view `[:, :batch, :, :max_len]` (requests
of different lengths are padded and masked). The running requests always occupy slots
0..batch-1: when one leaves, the last slot is moved into its place (`move`). Slots and capacity
grow by doubling, capacity up to the model's context length.

KV dtypes: `fp32`, `bf16` (a cast), `fp8_e4m3` (float8_e4m3fn with one fp32 scale per token per KV
head: amax / 448). Reads dequantize into the compute dtype, so every attention (prefill included)
sees the same rounded keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mixfleet.costmodel.specs.formats import formats

KV_DTYPES = formats().engine_kv_dtypes   # data/precisions.toml [kv_dtypes.*] servers = ["engine", ...]
FP8_E4M3_MAX = 448.0
_STORE = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp32": torch.float32}
_MIN_CAPACITY_TOKENS = 64
_MIN_SLOTS = 4


def quantize_kv(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., head_dim] -> (stored values, per-vector fp32 scale [...] or None)."""
    if kv_dtype == "fp8_e4m3":
        xf = x.to(torch.float32)
        scale = (xf.abs().amax(dim=-1) / FP8_E4M3_MAX).clamp_min(1e-12)
        q = (xf / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return q, scale
    return x.to(_STORE[kv_dtype]), None


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return q.to(dtype)
    return (q.to(torch.float32) * scale[..., None]).to(dtype)


@dataclass
class SessionKV:
    """A finished turn's KV kept for the session's next turn (prefix reuse)."""

    tokens: list[int]                # the ids whose KV is stored (prompt + output minus the last token)
    k: torch.Tensor                  # [layers, kv_heads, n, head_dim] stored dtype
    v: torch.Tensor
    k_scale: torch.Tensor | None     # [layers, kv_heads, n] (fp8 only)
    v_scale: torch.Tensor | None
    weight_version: str
    routed_experts: torch.Tensor | None = None   # MoE, when recorded: experts of those tokens [n, layers, k]


class KVPool:
    """Slot-per-request KV storage for one engine (not thread-safe: the engine thread owns it)."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, max_context: int, kv_dtype: str,
                 device: torch.device | str = "cpu") -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_dtype!r}: allowed {', '.join(KV_DTYPES)}")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.max_context, self.kv_dtype, self.device = max_context, kv_dtype, torch.device(device)
        self.slots, self.capacity = 0, 0
        self.k = self.v = torch.empty(0)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self._alloc(_MIN_SLOTS, min(_MIN_CAPACITY_TOKENS, max_context))

    # ---- storage ------------------------------------------------------------------------------
    def _alloc(self, slots: int, capacity: int) -> None:
        shape = (self.num_layers, slots, self.kv_heads, capacity, self.head_dim)
        k = torch.zeros(shape, dtype=_STORE[self.kv_dtype], device=self.device)
        v = torch.zeros(shape, dtype=_STORE[self.kv_dtype], device=self.device)
        fp8 = self.kv_dtype == "fp8_e4m3"
        ks = torch.ones(shape[:-1], dtype=torch.float32, device=self.device) if fp8 else None
        vs = torch.ones(shape[:-1], dtype=torch.float32, device=self.device) if fp8 else None
        if self.slots:
            s, c = self.slots, self.capacity
            k[:, :s, :, :c] = self.k
            v[:, :s, :, :c] = self.v
            if fp8:
                ks[:, :s, :, :c] = self.k_scale
                vs[:, :s, :, :c] = self.v_scale
        self.k, self.v, self.k_scale, self.v_scale = k, v, ks, vs
        self.slots, self.capacity = slots, capacity

    def ensure(self, slots: int, tokens: int) -> None:
        """Make room for `slots` requests of up to `tokens` tokens each."""
        if tokens > self.max_context:
            raise ValueError(f"{tokens} tokens exceed the context length {self.max_context}")
        new_s, new_c = self.slots, self.capacity
        while new_s < slots:
            new_s *= 2
        while new_c < tokens:
            new_c = min(new_c * 2, self.max_context)
        if (new_s, new_c) != (self.slots, self.capacity):
            self._alloc(new_s, new_c)

    # ---- writes and reads ---------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """k, v [n, kv_heads, head_dim] go to (slots[i], positions[i])."""
        kq, ks = quantize_kv(k, self.kv_dtype)
        vq, vs = quantize_kv(v, self.kv_dtype)
        self.k[layer, slots, :, positions] = kq
        self.v[layer, slots, :, positions] = vq
        if ks is not None:
            self.k_scale[layer, slots, :, positions] = ks
            self.v_scale[layer, slots, :, positions] = vs

    def read(self, layer: int, batch: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of slots 0..batch-1, positions 0..length-1: [batch, kv_heads, length, head_dim]."""
        k = self.k[layer, :batch, :, :length]
        v = self.v[layer, :batch, :, :length]
        ks = self.k_scale[layer, :batch, :, :length] if self.k_scale is not None else None
        vs = self.v_scale[layer, :batch, :, :length] if self.v_scale is not None else None
        return dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype)

    def read_slot(self, layer: int, slot: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K, V of one slot: [1, kv_heads, length, head_dim]."""
        s = slice(slot, slot + 1)
        k, v = self.k[layer, s, :, :length], self.v[layer, s, :, :length]
        ks = self.k_scale[layer, s, :, :length] if self.k_scale is not None else None
        vs = self.v_scale[layer, s, :, :length] if self.v_scale is not None else None
        return dequantize_kv(k, ks, dtype), dequantize_kv(v, vs, dtype)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot src's first `length` tokens into slot dst (compaction when a request leaves)."""
        if src == dst or length == 0:
            return
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        if self.k_scale is not None:
            self.k_scale[:, dst, :, :length] = self.k_scale[:, src, :, :length]
            self.v_scale[:, dst, :, :length] = self.v_scale[:, src, :, :length]

    # ---- sessions (prefix reuse) --------------------------------------------------------------
    def export(self, slot: int, tokens: list[int], weight_version: str) -> SessionKV:
        n = len(tokens)
        ks = self.k_scale[:, slot, :, :n].clone() if self.k_scale is not None else None
        vs = self.v_scale[:, slot, :, :n].clone() if self.v_scale is not None else None
        return SessionKV(list(tokens), self.k[:, slot, :, :n].clone(), self.v[:, slot, :, :n].clone(), ks, vs,
                         weight_version)

    def import_(self, slot: int, sess: SessionKV, n: int) -> None:
        """Put the first n tokens of a session's KV into a slot (the slot must have capacity >= n)."""
        self.k[:, slot, :, :n] = sess.k[:, :, :n]
        self.v[:, slot, :, :n] = sess.v[:, :, :n]
        if self.k_scale is not None and sess.k_scale is not None:
            self.k_scale[:, slot, :, :n] = sess.k_scale[:, :, :n]
            self.v_scale[:, slot, :, :n] = sess.v_scale[:, :, :n]

    @property
    def bytes_allocated(self) -> int:
        total = self.k.numel() * self.k.element_size() * 2
        if self.k_scale is not None:
            total += self.k_scale.numel() * 4 * 2
        return total
