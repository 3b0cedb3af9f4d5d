"""Weight quantization of the embedded engine: what each sampler precision does to a weight matrix.

A sampler group serves its weights in one precision; the engine quantizes the checkpoint's float
weights at load time and computes with the *dequantized* values (the quantization error is what
changes the numbers; the kernel dtype then decides the matmul's rounding). Formats:

- `fp32`: the reference, untouched.  `bf16`: round to bfloat16.
- `fp8`: E4M3 (`torch.float8_e4m3fn`) with one fp32 scale per 128x128 block (DeepSeek-V3 / SGLang
  block FP8) or per output channel; values saturate at +-448 before the cast.
- `nvfp4`: E2M1 in blocks of 16 along the input dim, E4M3 block scales, a per-tensor fp32 scale
  (torchao's reference `NVFP4Tensor`).
- `mxfp4`: E2M1 in blocks of 32, E8M0 (power-of-two) block scales (torchao's `MXTensor`).

Pure functions: tensors in, tensors out.
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass

import torch
from mixfleet.costmodel.specs.formats import formats

WEIGHT_PRECISIONS = formats().engine_precisions   # data/precisions.toml: servers = ["engine", ...]
FP8_SCALINGS = ("block", "channel")
FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128                      # block edge of block-scaled FP8 (elements)
NVFP4_BLOCK = 16                     # elements per NVFP4 scale
MXFP4_BLOCK = 32                     # elements per MXFP4 scale
_TINY_SCALE = 1e-12                  # floor for scales of all-zero blocks


def _import_mx():
    """torchao's mx_formats, imported quietly (its optional CUDA extensions log load failures on CPU)."""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from torchao.prototype.mx_formats.mx_tensor import MXTensor
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    finally:
        for lg, lvl in zip(loggers, old, strict=True):
            lg.setLevel(lvl)
    return MXTensor, NVFP4Tensor, per_tensor_amax_to_scale


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 weight as a real FP8 kernel consumes it: E4M3 data [out, in] and fp32 scales."""

    data: torch.Tensor               # float8_e4m3fn [out, in]
    scale: torch.Tensor              # fp32: [out, 1] (channel) or [ceil(out/128), ceil(in/128)] (block)
    scaling: str                     # "block" | "channel"

    def dequantize(self) -> torch.Tensor:
        x = self.data.to(torch.float32)
        if self.scaling == "channel":
            return x * self.scale
        out, inp = x.shape
        s = self.scale.repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :inp]
        return x * s


def quantize_fp8(w: torch.Tensor, scaling: str = "block") -> Fp8Weight:
    """E4M3 with per-128x128-block or per-output-channel scales (amax / 448), saturating at 448."""
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8 scaling {scaling!r}: allowed {', '.join(FP8_SCALINGS)}")
    w = w.to(torch.float32)
    if w.dim() != 2:
        raise ValueError(f"fp8 quantization takes a 2-D weight, got shape {tuple(w.shape)}")
    if scaling == "channel":
        scale = (w.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp_min(_TINY_SCALE)
        q = (w / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return Fp8Weight(q, scale, "channel")
    out, inp = w.shape
    bo, bi = -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK)
    padded = torch.zeros(bo * FP8_BLOCK, bi * FP8_BLOCK, dtype=torch.float32, device=w.device)
    padded[:out, :inp] = w
    blocks = padded.view(bo, FP8_BLOCK, bi, FP8_BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_E4M3_MAX).clamp_min(_TINY_SCALE)       # [bo, bi]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.view(bo * FP8_BLOCK, bi * FP8_BLOCK)[:out, :inp].contiguous()
    return Fp8Weight(q, scale, "block")


def _pad_cols(w: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = (-w.shape[-1]) % multiple
    return torch.nn.functional.pad(w, (0, extra)) if extra else w


def fake_quantize_nvfp4(w: torch.Tensor) -> torch.Tensor:
    """NVFP4 round trip (torchao reference): E2M1 values, E4M3 scales per 16, per-tensor fp32 scale."""
    _, NVFP4Tensor, per_tensor_amax_to_scale = _import_mx()
    w32 = w.to(torch.float32)
    padded = _pad_cols(w32, NVFP4_BLOCK).contiguous()
    amax = padded.abs().max()
    per_tensor = per_tensor_amax_to_scale(amax) if float(amax) > 0 else None
    t = NVFP4Tensor.to_nvfp4(padded, block_size=NVFP4_BLOCK, per_tensor_scale=per_tensor)
    return t.dequantize(torch.float32)[..., : w.shape[-1]].contiguous()


def fake_quantize_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 round trip (torchao reference, OCP MX): E2M1 values, E8M0 scales per 32."""
    MXTensor, _, _ = _import_mx()
    w32 = w.to(torch.float32)
    padded = _pad_cols(w32, MXFP4_BLOCK).contiguous()
    t = MXTensor.to_mx(padded, torch.float4_e2m1fn_x2, MXFP4_BLOCK)
    return t.dequantize(torch.float32)[..., : w.shape[-1]].contiguous()


def fake_quantize(w: torch.Tensor, precision: str, *, fp8_scaling: str = "block") -> torch.Tensor:
    """The fp32 values a weight takes after quantization to `precision` and dequantization."""
    if precision == "fp32":
        return w.to(torch.float32)
    if precision == "bf16":
        return w.to(torch.bfloat16).to(torch.float32)
    if precision == "fp8":
        return quantize_fp8(w, fp8_scaling).dequantize()
    if precision == "nvfp4":
        return fake_quantize_nvfp4(w)
    if precision == "mxfp4":
        return fake_quantize_mxfp4(w)
    raise ValueError(f"precision {precision!r}: allowed {', '.join(WEIGHT_PRECISIONS)}")


def relative_error(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    """||w_hat - w|| / ||w|| (Frobenius), in fp64."""
    w64, h64 = w.to(torch.float64), w_hat.to(torch.float64)
    return float((h64 - w64).norm() / w64.norm().clamp_min(1e-300))
