"""The measured backend: replica step times from NVIDIA's aiconfigurator-core profiled databases.

aiconfigurator-core (PyPI `aiconfigurator-core`, Apache-2.0, pinned in pyproject.toml) ships op-level
performance tables measured on H100 / H200 / B200 / B300 / A100 / RTX PRO 6000 for the SGLang, TensorRT-LLM
and vLLM engines, and composes them (GEMMs, attention, MoE, all-reduce / all-to-all) into the decode-step
and prefill latency of a model in a layout (TP, attention DP, MoE TP / EP) and quantization, on a CPU, with
no download. This module is the one place mixfleet touches it:

- `coverage(...)` says whether its support matrix covers a (model, accelerator, precision, KV dtype, engine,
  layout) and, if not, why (the catalog shows it);
- `step_table(...)` compiles the model once and tabulates decode-step seconds over (replica batch, context)
  and prefill seconds over (new tokens, cached context) into a `StepTable`: plain numpy arrays. A
  ReplicaModel built with `backend="aiconfigurator"` (roofline.replica_model) interpolates that table, so
  the twin's per-event lookups never import aiconfigurator (tables are cached per process).

Only model shapes the database has profiled are covered (its MoE tables are keyed by the exact expert
shape): a model spec names the published config it reproduces (`hf_id`), which must be one of the configs
aiconfigurator bundles (or `HF_ALIASES`: the same architecture under another name). Everything else, the
CPU, emulated formats and FP32 stay on the roofline.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import Accelerator, KVDtype, Precision
from mixfleet.costmodel.specs.model import ModelSpec

PACKAGE = "aiconfigurator-core"
PINNED_VERSION = "0.12.0"          # the version this adapter was written and checked against
ENGINES = ("sglang", "trtllm", "vllm")
DEFAULT_ENGINE = "sglang"          # mixfleet's GPU samplers are SGLang servers
# a replica's engines to try in order: SGLang's tables first; where SGLang's database lacks the model's shape
# (e.g. NVFP4 MoE kernels for Qwen3-30B on B200), TensorRT-LLM's measured kernels (the source line says which)
DEFAULT_ENGINES = ("sglang", "trtllm")

# catalog accelerator -> aiconfigurator system name
SYSTEMS = {"H100": "h100_sxm", "H200": "h200_sxm", "B200": "b200_sxm", "B300": "b300_sxm",
           "A100-80GB": "a100_sxm", "RTX-PRO-6000": "rtx_pro_6000_server"}

# published models whose architecture is a bundled config under another name
HF_ALIASES = {"meta-llama/Llama-3.3-70B-Instruct": "meta-llama/Meta-Llama-3.1-70B",
              "meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Meta-Llama-3.1-8B",
              "meta-llama/Llama-3.1-70B-Instruct": "meta-llama/Meta-Llama-3.1-70B"}

# mixfleet precision -> (GEMM quant modes, MoE quant modes), first supported wins. Our fp8 is block-scaled
# (128x128) like DeepSeek-style FP8 checkpoints; per-tensor fp8 is the engine's next best kernel. mxfp4 is
# gpt-oss's MoE format (attention stays BF16 there): only MoE models map it.
QUANT = {"bf16": (("bfloat16",), ("bfloat16",)),
         "fp8": (("fp8_block", "fp8"), ("fp8_block", "fp8")),
         "nvfp4": (("nvfp4",), ("nvfp4",)),
         "mxfp4": (("bfloat16",), ("w4a8_mxfp4_mxfp8", "w4a16_mxfp4"))}
# emulated formats the engines run as weight-only kernels (dequantized into the BF16 MMA): our "emulated" means
# exactly that, so these stay measured; every other emulated format is the roofline's
QUANT_EMULATED = {"mxfp4": (("bfloat16",), ("w4a16_mxfp4",))}
KV_QUANT = {"bf16": "bfloat16", "fp8_e4m3": "fp8"}

# the tabulation grid: replica batch x context for decode, new tokens x cached context for prefill; the replica
# batches reach 2048 per rank on 8 attention-DP ranks (the offline cap of the published-figures comparison)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
                  8192, 12288, 16384)
CONTEXTS = (1, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
PREFILL_TOKENS = (1, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
PREFILL_CONTEXTS = (0, 1024, 4096, 16384, 65536)


class NotCovered(SpecError):
    """aiconfigurator-core's support matrix does not cover this replica: the message says which part."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one replica's GPUs split the model: attention TP x attention DP GPUs; MoE experts over `ep` of them
    (MoE TP = gpus / ep). tp=n, dp=1, ep=1 is plain tensor parallelism (today's roofline)."""

    tp: int = 1
    dp_attention: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp_attention", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError("layout", name, v, "a positive integer")
        if self.gpus % self.ep:
            raise SpecError("layout", "ep", self.ep, f"a divisor of tp x dp_attention ({self.gpus})")

    @classmethod
    def parse(cls, label: str) -> Layout:
        """'TP4', 'TP4-EP4', 'DEP8', 'TP2-DP2-EP4' (the `label` forms) -> Layout; SpecError otherwise."""
        import re

        s = label.strip().upper()
        m = re.fullmatch(r"DEP(\d+)", s)
        if m:
            n = int(m.group(1))
            return cls(tp=1, dp_attention=n, ep=n)
        m = re.fullmatch(r"TP(\d+)(?:-DP(\d+))?(?:-EP(\d+))?", s)
        if not m:
            raise SpecError("layout", "label", label, "TP<n>, TP<n>-EP<n>, DEP<n> or TP<a>-DP<b>-EP<n>")
        return cls(tp=int(m.group(1)), dp_attention=int(m.group(2) or 1), ep=int(m.group(3) or 1))

    @property
    def gpus(self) -> int:
        return self.tp * self.dp_attention

    @property
    def moe_tp(self) -> int:
        return self.gpus // self.ep

    @property
    def label(self) -> str:
        """'TP4', 'TP4-EP4', 'DEP4' (attention DP 4 + EP 4), 'TP2-DP2-EP4'."""
        if self.dp_attention == 1:
            return f"TP{self.tp}" + (f"-EP{self.ep}" if self.ep > 1 else "")
        if self.tp == 1 and self.ep == self.gpus:
            return f"DEP{self.gpus}"
        return f"TP{self.tp}-DP{self.dp_attention}" + (f"-EP{self.ep}" if self.ep > 1 else "")


@dataclass(frozen=True, kw_only=True)
class StepTable:
    """Measured-backend step times on a grid (seconds), interpolated bilinearly; `source` says what priced it."""

    source: str                       # e.g. "aiconfigurator-core 0.12.0, sglang 0.5.14, h200_sxm, gemm fp8_block ..."
    batches: np.ndarray               # replica batch (all attention-DP ranks together)
    contexts: np.ndarray
    decode_s: np.ndarray              # [batch, context]
    prefill_tokens: np.ndarray
    prefill_contexts: np.ndarray
    prefill_s: np.ndarray             # [new tokens, cached context], one request

    def decode(self, batch: Any, context: Any) -> np.ndarray:
        return _bilinear(self.batches, self.contexts, self.decode_s, np.asarray(batch, dtype=np.float64),
                         np.asarray(context, dtype=np.float64))

    def prefill(self, new_tokens: Any, context_before: Any) -> np.ndarray:
        n = np.asarray(new_tokens, dtype=np.float64)
        out = _bilinear(self.prefill_tokens, self.prefill_contexts, self.prefill_s, n,
                        np.asarray(context_before, dtype=np.float64))
        return np.where(n > 0, out, 0.0)


def _axis(xs: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Interval index and weight on a sorted axis; linear extrapolation past the ends."""
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return i, w


def _bilinear(xs: np.ndarray, ys: np.ndarray, z: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x, y = np.broadcast_arrays(x, y)
    i, wx = _axis(xs, x)
    j, wy = _axis(ys, y)
    wx = np.maximum(wx, 0.0) if xs[0] > 0 else wx  # below the first batch: hold (a step never gets cheaper)
    z00, z10, z01, z11 = z[i, j], z[i + 1, j], z[i, j + 1], z[i + 1, j + 1]
    out = (1 - wx) * ((1 - wy) * z00 + wy * z01) + wx * ((1 - wy) * z10 + wy * z11)
    out = np.maximum(out, 0.0)
    return out


# ---- what aiconfigurator offers -----------------------------------------------------------------------

def installed_version() -> str | None:
    """aiconfigurator-core's installed version, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return None


def _quiet() -> None:
    # it logs a warning per low-fidelity fallback table it loads; mixfleet reports coverage itself
    logging.getLogger("aiconfigurator_core").setLevel(logging.ERROR)


@lru_cache(maxsize=1)
def _bundled_models() -> frozenset[str]:
    from aiconfigurator_core.sdk import common

    return frozenset(common.DefaultHFModels)


@lru_cache(maxsize=64)
def _engine_version(system: str, engine: str) -> str:
    """The engine version of the database's 'current' slot for a system (NotCovered if it has none)."""
    _quiet()
    from aiconfigurator_core.sdk import perf_database

    try:
        return str(perf_database.resolve_query_version(system, engine, "current"))
    except Exception as e:
        raise NotCovered("aiconfigurator", "system", f"{system}/{engine}",
                         f"a system with a database for the engine ({type(e).__name__})") from None


def hf_model(model: ModelSpec) -> str | None:
    """The bundled aiconfigurator config this spec reproduces (its hf_id, or an alias of it), or None."""
    if not model.hf_id:
        return None
    name = HF_ALIASES.get(model.hf_id, model.hf_id)
    return name if name in _bundled_models() else None


def _pick(wanted: tuple[str, ...], have: tuple[str, ...]) -> str | None:
    return next((w for w in wanted if w in have), None)


@dataclass(frozen=True, kw_only=True)
class Coverage:
    """A configuration the static support checks pass: what to try compiling (first profiled option wins)."""

    model_path: str
    system: str
    engine: str
    engine_version: str
    gemm: tuple[str, ...]             # GEMM quant modes to try, in order
    moe: tuple[str, ...] | None       # MoE quant modes to try (None: dense model)
    kv: str
    layout: Layout

    def source(self, gemm: str, moe: str | None, fmha: str) -> str:
        q = f"gemm {gemm}" + (f", moe {moe}" if moe else "") + f", kv {self.kv}, fmha {fmha}"
        return (f"{PACKAGE} {installed_version()}, {self.engine} {self.engine_version}, {self.system}, "
                f"{self.model_path}, {self.layout.label}, {q}")


def coverage(model: ModelSpec, accelerator: Accelerator, precision: Precision, kv_dtype: KVDtype, *,
             layout: Layout, engine: str = DEFAULT_ENGINE, emulated: bool = False) -> Coverage:
    """The static part of the support matrix (no database load): NotCovered names the part that fails. Whether
    the database has profiled the exact shapes is known only when compiling (`step_table`)."""
    where = f"measured backend for {model.name} on {accelerator.name}/{precision.name}"
    if engine not in ENGINES:
        raise SpecError(where, "engine", engine, ENGINES)
    if installed_version() is None:
        raise NotCovered(where, "aiconfigurator", None, f"`pip install {PACKAGE}=={PINNED_VERSION}`")
    table = QUANT_EMULATED if emulated else QUANT
    if emulated and precision.name not in table or (emulated and model.moe is None):
        raise NotCovered(where, "emulated", True, "a native precision (emulated formats stay on the roofline, "
                         "except MXFP4 MoE experts, which engines run weight-only)")
    system = SYSTEMS.get(accelerator.name)
    if system is None:
        raise NotCovered(where, "accelerator", accelerator.name, sorted(SYSTEMS))
    path = hf_model(model)
    if path is None:
        raise NotCovered(where, "model", model.hf_id or model.name,
                         "a spec whose hf_id is a model aiconfigurator profiled (data/models/*.toml with hf_id)")
    if precision.name not in table:
        raise NotCovered(where, "precision", precision.name, sorted(table))
    if precision.name == "mxfp4" and model.moe is None:
        raise NotCovered(where, "precision", "mxfp4", "bf16/fp8/nvfp4 for a dense model (mxfp4 maps to MoE kernels)")
    if kv_dtype.name not in KV_QUANT:
        raise NotCovered(where, "kv_dtype", kv_dtype.name, sorted(KV_QUANT))
    if model.moe is None and (layout.ep > 1 or layout.dp_attention > 1):
        raise NotCovered(where, "layout", layout.label, "TP only for a dense model")
    gemm, moe = table[precision.name]
    return Coverage(model_path=path, system=system, engine=engine, engine_version=_engine_version(system, engine),
                    gemm=gemm, moe=moe if model.moe is not None else None, kv=KV_QUANT[kv_dtype.name], layout=layout)


# ---- compiling and tabulating -------------------------------------------------------------------------

@lru_cache(maxsize=256)
def _compile(cov: Coverage) -> tuple[Any, str]:
    """The compiled engine and its source line: the first (GEMM, MoE, FMHA) quant modes the database has
    profiled for this model and layout; NotCovered (with the engine's own message) when none."""
    _quiet()
    from aiconfigurator_core.sdk.engine import EngineHandle

    lay = cov.layout
    fmhas = ("fp8", "bfloat16") if cov.kv == "fp8" else ("bfloat16",)
    base: dict[str, Any] = {"tp_size": lay.tp, "attention_dp_size": lay.dp_attention, "kvcache_quant_mode": cov.kv}
    if cov.moe is not None:
        base.update(moe_tp_size=lay.moe_tp, moe_ep_size=lay.ep)
    last: Exception | None = None
    for gemm in cov.gemm:
        for moe in cov.moe or (None,):
            for fmha in fmhas:  # the context-attention kernel: FP8 where the engine has it with an FP8 KV
                kw = dict(base, gemm_quant_mode=gemm, fmha_quant_mode=fmha)
                if moe is not None:
                    kw["moe_quant_mode"] = moe
                try:
                    h = EngineHandle.compile(cov.model_path, cov.system, cov.engine,
                                             backend_version=cov.engine_version, **kw)
                    h.predict_prefill_latency(1, 1024, 0)
                    h.predict_decode_latency(1, 1024, 2)
                    return h, cov.source(gemm, moe, fmha)
                except Exception as e:  # PerfDataNotAvailableError (shape not profiled), ValueError (layout)
                    last = e
    raise NotCovered(f"measured backend ({cov.model_path} on {cov.system}/{cov.engine}, {lay.label})",
                     "profiled data", "missing",
                     f"a configuration the database has measured ({type(last).__name__}: {str(last)[:160]})")


def decode_batches(max_batch: int) -> np.ndarray:
    """The decode table's replica-batch axis: `DECODE_BATCHES` up to `max_batch`, `max_batch` appended where the
    grid stops short of it, at least two points. A step past the last point would be a linear extrapolation, so
    the grid reaches every batch the replica is asked for (until issue 25 it stopped at 2048 whatever the cap: a
    DEP8 replica at 2048 per rank was extrapolated from 256 per rank on)."""
    cap = max(int(max_batch), 2)
    bs = [b for b in DECODE_BATCHES if b <= cap]
    if bs[-1] < cap:
        bs.append(cap)
    return np.array(bs, dtype=np.float64)


@lru_cache(maxsize=256)
def _table(cov: Coverage, max_batch: int, max_context: int) -> StepTable:
    h, source = _compile(cov)
    dp = cov.layout.dp_attention
    bs = decode_batches(max_batch)
    ctx = np.array([c for c in CONTEXTS if c <= max(max_context, 256)], dtype=np.float64)
    if ctx[-1] < max_context:
        ctx = np.append(ctx, float(max_context))
    dec = np.empty((len(bs), len(ctx)))
    for i, b in enumerate(bs):
        per_rank = max(1, math.ceil(b / dp))  # each attention-DP rank runs its share of the batch
        for j, c in enumerate(ctx):
            dec[i, j] = h.predict_decode_latency(per_rank, max(1, int(c)), 2) / 1e3
    new = np.array([n for n in PREFILL_TOKENS if n <= max(max_context, 64)], dtype=np.float64)
    if new[-1] < max_context:  # up to the longest prompt the replica holds: no extrapolation of attention
        new = np.append(new, float(max_context))
    pctx = np.array([c for c in PREFILL_CONTEXTS if c < max(max_context, 1024)], dtype=np.float64)
    if len(pctx) < 2:  # a short context limit (<= 1024): one column would interpolate to NaN
        pctx = np.append(pctx, float(max(max_context, 1)))
    pre = np.empty((len(new), len(pctx)))
    for i, n in enumerate(new):
        for j, c in enumerate(pctx):
            pre[i, j] = h.predict_prefill_latency(1, int(c + n), int(c)) / 1e3
    return StepTable(source=source, batches=bs, contexts=ctx, decode_s=dec, prefill_tokens=new,
                     prefill_contexts=pctx, prefill_s=pre)


def step_table(model: ModelSpec, accelerator: Accelerator, precision: Precision, kv_dtype: KVDtype, *,
               layout: Layout, engine: str = DEFAULT_ENGINE, emulated: bool = False, max_batch: int = 1024,
               max_context: int | None = None) -> StepTable:
    """The replica's measured decode / prefill table (compiled and tabulated once per process and config)."""
    cov = coverage(model, accelerator, precision, kv_dtype, layout=layout, engine=engine, emulated=emulated)
    return _table(cov, int(max_batch), int(max_context or model.max_context))


def run_static(model: ModelSpec, accelerator: Accelerator, precision: Precision, kv_dtype: KVDtype, *,
               layout: Layout, engine: str, batch: int, isl: int, osl: int) -> dict[str, float]:
    """aiconfigurator's own static-batch estimate (per attention-DP rank batch = batch / dp): context, generation
    and total milliseconds. Used by the comparison with published figures as a cross-check of the table."""
    cov = coverage(model, accelerator, precision, kv_dtype, layout=layout, engine=engine)
    h, _ = _compile(cov)
    ctx_ms, gen_ms, tot_ms = h.run_static(batch_size=max(1, math.ceil(batch / layout.dp_attention)), isl=isl, osl=osl)
    return {"context_ms": ctx_ms, "generation_ms": gen_ms, "total_ms": tot_ms}


def cache_info() -> dict[str, Any]:
    """Process cache of compiled tables (for benchmarks)."""
    ci = _table.cache_info()
    return {"hits": ci.hits, "misses": ci.misses, "size": ci.currsize, "pid": os.getpid()}
