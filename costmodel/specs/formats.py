"""The one format registry: which weight precisions, KV-cache dtypes and kernel (matmul) dtypes exist, and
which sampler serves which, as `data/precisions.toml` says (read through the catalog).

Everything that accepts a format name derives its list from here instead of writing one by hand: the plan
(policies/plan.py checks a group's `precision`, `kv_dtype` and `kernel` once, at load), the embedded
engine (runner/sampler/engine/quant.py, kvcache.py, model.py), its server and API
(runner/sampler/engine_api.py, server.py), the SGLang launcher (runner/sampler/sglang_launch.py), the fleet
(runner/orchestration/fleet.py), the UI (ui/app_plan.py) and the reports (costmodel/steptime/report.py).

    formats().engine_precisions      -> ("fp32", "bf16", "fp8", "nvfp4", "mxfp4")
    formats().sglang_quantization    -> {"bf16": None, "fp8": "fp8", "nvfp4": "modelopt_fp4", ...}
    formats().check_precision("plan group 'x'", "fp16")  -> SpecError naming the field and the allowed values
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import Catalog, load_catalog

GPU_ARCHS = ("ampere", "hopper", "blackwell")


@dataclass(frozen=True, kw_only=True)
class Formats:
    """Format names by role, in the catalog's order."""

    precisions: tuple[str, ...]               # every weight format the catalog knows
    kv_dtypes: tuple[str, ...]                # every KV-cache dtype
    kernels: tuple[str, ...]                  # dtypes the embedded engine computes (matmuls) in
    engine_precisions: tuple[str, ...]        # weight formats the embedded engine serves
    engine_kv_dtypes: tuple[str, ...]
    sglang_precisions: tuple[str, ...]        # weight formats SGLang serves
    sglang_kv_dtypes: tuple[str, ...]
    gpu_precisions: tuple[str, ...]           # native on some GPU architecture (what a GPU fleet is planned in)
    sglang_quantization: Mapping[str, str | None]   # precision -> SGLang --quantization (None: no flag)
    sglang_kv_cache_dtype: Mapping[str, str]        # KV dtype -> SGLang --kv-cache-dtype ("auto": the model's)

    @staticmethod
    def from_catalog(cat: Catalog) -> Formats:
        precs, kvs = cat.precisions.values(), cat.kv_dtypes.values()
        return Formats(
            precisions=tuple(p.name for p in precs), kv_dtypes=tuple(k.name for k in kvs),
            kernels=tuple(p.name for p in precs if p.kernel),
            engine_precisions=tuple(p.name for p in precs if "engine" in p.servers),
            engine_kv_dtypes=tuple(k.name for k in kvs if "engine" in k.servers),
            sglang_precisions=tuple(p.name for p in precs if "sglang" in p.servers),
            sglang_kv_dtypes=tuple(k.name for k in kvs if "sglang" in k.servers),
            gpu_precisions=tuple(p.name for p in precs if set(p.native_arch) & set(GPU_ARCHS)),
            sglang_quantization=MappingProxyType({p.name: p.sglang_quantization or None for p in precs
                                                  if "sglang" in p.servers}),
            sglang_kv_cache_dtype=MappingProxyType({k.name: k.sglang_kv_cache_dtype for k in kvs
                                                    if "sglang" in k.servers}))

    @staticmethod
    def check(where: str, field: str, value: object, allowed: tuple[str, ...]) -> str:
        """`value` if it is one of `allowed`, else a SpecError naming where, the field, the value and `allowed`."""
        if not isinstance(value, str) or value not in allowed:
            raise SpecError(where, field, value, allowed)
        return value

    def check_precision(self, where: str, value: object, field: str = "precision") -> str:
        return self.check(where, field, value, self.precisions)

    def check_kv_dtype(self, where: str, value: object, field: str = "kv_dtype") -> str:
        return self.check(where, field, value, self.kv_dtypes)

    def check_kernel(self, where: str, value: object, field: str = "kernel") -> str:
        return self.check(where, field, value, self.kernels)


@lru_cache(maxsize=1)
def formats() -> Formats:
    """The shipped registry (data/precisions.toml)."""
    return Formats.from_catalog(load_catalog())
