"""`EngineConfig`: how one embedded engine serves (precision, KV dtype, kernel, capacity limits), checked on
construction. The engine that takes it is engine.py's `Engine`.
"""

from __future__ import annotations

from dataclasses import dataclass

from mixfleet.runner.sampler.engine.kvcache import KV_DTYPES
from mixfleet.runner.sampler.engine.model import KERNEL_DTYPES, scaled_mm_unsupported
from mixfleet.runner.sampler.engine.quant import FP8_SCALINGS, WEIGHT_PRECISIONS

NOISE_TAG = "+noise"    # the retired kernel spelling of the emulated kernel error ("bf16+noise0.3"): refused


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How one engine serves: precision, KV dtype, kernel, and its capacity limits."""

    precision: str = "bf16"                  # weight format: fp32 | bf16 | fp8 | nvfp4 | mxfp4
    kv_cache_dtype: str = "bf16"             # bf16 | fp8_e4m3 | fp32
    kernel: str | None = None                # matmul dtype: fp32 | bf16 (None: fp32 for fp32 weights, else bf16)
    max_total_tokens: int = 65536            # KV-token budget (prompt + max_new_tokens reserved per request)
    max_running_requests: int = 64           # batch size limit
    sampling_mask_max_tokens: int = 512      # largest kept set a request may ask to have returned
    fp8_scaling: str = "block"               # fp8 weight scales: block (128x128) | channel
    fp8_scaled_mm: bool = False              # fp8 linears as real FP8 GEMMs (torch._scaled_mm; Hopper+ or CPU)
    device: str = "cpu"
    seed: int = 0                            # seeds requests that bring no sampling_seed
    max_cached_sessions: int = 256           # sessions whose last turn's KV is kept (LRU; their tokens
                                             # together at most max_total_tokens)
    weight_noise: float = 0.0                # emulated kernel error, relative std (0 = off; model.py's doc):
                                             # the ablation study's mismatch knob, seeded by `seed`
    enable_return_routed_experts: bool = False  # MoE: record every token's experts (SGLang's server flag), so
                                             # requests may ask for them (return_routed_experts)

    def __post_init__(self) -> None:
        def bad(name: str, allowed: object) -> ValueError:
            return ValueError(f"engine config: {name} = {getattr(self, name)!r}; allowed: {allowed}")

        if self.precision not in WEIGHT_PRECISIONS:
            raise bad("precision", ", ".join(WEIGHT_PRECISIONS))
        if self.kv_cache_dtype not in KV_DTYPES:
            raise bad("kv_cache_dtype", ", ".join(KV_DTYPES))
        if isinstance(self.kernel, str) and NOISE_TAG in self.kernel:
            dtype, _, value = self.kernel.partition(NOISE_TAG)
            raise bad("kernel", f"{', '.join(KERNEL_DTYPES)}; the emulated kernel error is its own setting now: "
                                f"kernel={dtype or None!r}, weight_noise={value or '<relative std>'}")
        if self.kernel is not None and self.kernel not in KERNEL_DTYPES:
            raise bad("kernel", ", ".join(KERNEL_DTYPES))
        if not (isinstance(self.weight_noise, int | float) and 0.0 <= self.weight_noise < 10.0):
            raise bad("weight_noise", "a number in [0, 10)")
        if self.weight_noise > 0 and self.fp8_scaled_mm:
            raise bad("weight_noise", "0 with fp8_scaled_mm")
        if self.fp8_scaling not in FP8_SCALINGS:
            raise bad("fp8_scaling", ", ".join(FP8_SCALINGS))
        for name in ("max_total_tokens", "max_running_requests", "sampling_mask_max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise bad(name, "a positive integer")
        if not isinstance(self.max_cached_sessions, int) or self.max_cached_sessions < 0:
            raise bad("max_cached_sessions", "an integer >= 0")
        if self.fp8_scaled_mm and self.precision != "fp8":
            raise bad("fp8_scaled_mm", "True only with precision 'fp8'")
        if self.fp8_scaled_mm and (why := scaled_mm_unsupported(self.device)):
            raise bad("fp8_scaled_mm", f"False here ({why})")
        if not isinstance(self.enable_return_routed_experts, bool):
            raise bad("enable_return_routed_experts", "true or false")

    @property
    def kernel_dtype(self) -> str:
        return self.kernel or ("fp32" if self.precision == "fp32" else "bf16")
