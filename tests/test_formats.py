"""One format registry (data/precisions.toml) behind every list of accepted formats (issue 12 item 1)."""

from __future__ import annotations

from mixfleet.costmodel.specs.catalog import load_catalog
from mixfleet.costmodel.specs.formats import formats


# ---- the registry ---------------------------------------------------------------------------------------
def test_every_accepting_list_is_the_registry() -> None:
    from mixfleet.costmodel.steptime import report
    from mixfleet.runner.orchestration import fleet
    from mixfleet.runner.sampler import engine_api, server_state, sglang_launch
    from mixfleet.runner.sampler.engine import kvcache, model, quant
    from mixfleet.ui import app_plan, app_planner

    f, cat = formats(), load_catalog()
    assert f.precisions == tuple(cat.precisions) and f.kv_dtypes == tuple(cat.kv_dtypes)
    assert quant.WEIGHT_PRECISIONS == engine_api.PRECISIONS == fleet.ENGINE_PRECISIONS == f.engine_precisions
    assert kvcache.KV_DTYPES == engine_api.KV_CACHE_DTYPES == fleet.ENGINE_KV_DTYPES == f.engine_kv_dtypes
    assert tuple(model.KERNEL_DTYPES) == engine_api.KERNELS == f.kernels == ("fp32", "bf16")
    assert sglang_launch.SGLANG_PRECISIONS == f.sglang_precisions == ("bf16", "fp8", "nvfp4", "mxfp4")
    assert sglang_launch.SGLANG_KV_DTYPES == f.sglang_kv_dtypes == ("bf16", "fp8_e4m3")
    assert dict(sglang_launch.QUANTIZATION_FLAG) == {"bf16": None, "fp8": "fp8", "nvfp4": "modelopt_fp4",
                                                     "mxfp4": "mxfp4"}
    assert server_state.QUANTIZATION_NAME == {"fp32": None, **sglang_launch.QUANTIZATION_FLAG}
    assert report.DEFAULT_PRECISIONS == app_plan.PRECISIONS == f.gpu_precisions == ("bf16", "fp8", "nvfp4", "mxfp4")
    assert set(app_planner.KV_DTYPES) == {"bf16", "fp8_e4m3"}


def test_every_engine_precision_has_a_quantizer() -> None:
    import torch
    from mixfleet.runner.sampler.engine.quant import fake_quantize

    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for p in formats().engine_precisions:
        assert fake_quantize(w, p).shape == w.shape
