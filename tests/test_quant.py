"""Weight and KV quantization of the embedded engine: each format's error on Gaussian weights is in its
expected range (fp8 ~2-3 %, nvfp4 ~10 %, mxfp4 ~12 % relative), FP8 saturates and keeps its block
structure, odd shapes work, and bad names are refused with the allowed values."""

from __future__ import annotations

import pytest
import torch
from mixfleet.runner.sampler.engine.kvcache import dequantize_kv, quantize_kv
from mixfleet.runner.sampler.engine.quant import (
    FP8_E4M3_MAX,
    fake_quantize,
    quantize_fp8,
    relative_error,
)


@pytest.fixture(scope="module")
def gaussian() -> torch.Tensor:
    return torch.randn(256, 512, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("precision", "lo", "hi"), [
    ("bf16", 1e-3, 4e-3),
    ("fp8", 0.015, 0.035),
    ("nvfp4", 0.07, 0.12),
    ("mxfp4", 0.09, 0.15),
])
def test_relative_error_in_expected_range(gaussian: torch.Tensor, precision: str, lo: float, hi: float) -> None:
    err = relative_error(gaussian, fake_quantize(gaussian, precision))
    assert lo < err < hi, f"{precision}: relative error {err:.4f} outside ({lo}, {hi})"


def test_error_order_and_fp32_identity(gaussian: torch.Tensor) -> None:
    errs = {p: relative_error(gaussian, fake_quantize(gaussian, p)) for p in ("fp32", "bf16", "fp8", "nvfp4", "mxfp4")}
    assert errs["fp32"] == 0.0
    assert errs["bf16"] < errs["fp8"] < errs["nvfp4"] < errs["mxfp4"]


def test_fp8_channel_scaling_error_and_scales(gaussian: torch.Tensor) -> None:
    q = quantize_fp8(gaussian, "channel")
    assert q.scale.shape == (256, 1)
    assert 0.015 < relative_error(gaussian, q.dequantize()) < 0.035
    # each row's largest magnitude maps to 448 exactly (amax scaling)
    assert torch.equal(q.data.float().abs().amax(dim=1), torch.full((256,), FP8_E4M3_MAX))


def test_fp8_block_scales_odd_shape_and_saturation() -> None:
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(1))
    w[5, 7] = 1e6                                        # one outlier: only its block's scale grows
    q = quantize_fp8(w, "block")
    assert q.scale.shape == (2, 3)
    assert q.data.shape == (200, 300) and q.data.dtype == torch.float8_e4m3fn
    deq = q.dequantize()
    assert torch.isfinite(deq).all()
    assert q.data.float().abs().max() <= FP8_E4M3_MAX
    assert deq[5, 7] == pytest.approx(1e6, rel=0.07)
    # blocks without the outlier keep fp8-level error
    rest = (slice(128, 200), slice(128, 300))
    assert relative_error(w[rest], deq[rest]) < 0.035


def test_fp4_formats_pad_odd_input_dims() -> None:
    w = torch.randn(64, 688, generator=torch.Generator().manual_seed(2))   # 688 = 21.5 blocks of 32
    for p in ("nvfp4", "mxfp4"):
        d = fake_quantize(w, p)
        assert d.shape == w.shape
        assert relative_error(w, d) < 0.15


def test_unknown_precision_names_allowed_values() -> None:
    with pytest.raises(ValueError, match="allowed fp32, bf16, fp8, nvfp4, mxfp4"):
        fake_quantize(torch.ones(4, 4), "int3")
    with pytest.raises(ValueError, match="allowed block, channel"):
        quantize_fp8(torch.ones(4, 4), "tensor")


def test_kv_fp8_per_token_head_scale_close() -> None:
    magnitudes = torch.linspace(0.01, 100, 10)[:, None, None]
    x = torch.randn(10, 2, 64, generator=torch.Generator().manual_seed(3)) * magnitudes
    q, s = quantize_kv(x, "fp8_e4m3")
    assert q.dtype == torch.float8_e4m3fn and s.shape == (10, 2)
    back = dequantize_kv(q, s, torch.float32)
    for i in range(10):                                  # per-token scales: every magnitude keeps ~fp8 error
        assert relative_error(x[i], back[i]) < 0.04
    qb, sb = quantize_kv(x, "bf16")
    assert sb is None and relative_error(x, dequantize_kv(qb, sb, torch.float32)) < 4e-3
