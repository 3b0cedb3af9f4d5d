"""The step-time, memory-fit and price model of one sampler replica, the trainer and weight sync.

A roofline with efficiency factors (ARCHITECTURE.md, "costmodel/"):

    decode step(B, L) = max(bytes / (tp * BW * eff_bw), flops / (tp * peak * eff_flops))
                        + TP all-reduce time + decode_overhead_s        (x emulation_slowdown)

bytes = quantized attention + dense FFN weights + the routed experts actually touched
(`E * (1 - (1 - k/E)^B)` per layer, uniform routing) + shared experts + high-precision router,
LM head and embedding rows + the KV cache of B sequences of L tokens (+ the new token's KV);
flops = 2 * active_params * B + attention 4 * B * L * layers * heads * head_dim. Prefill is the
same sum over the new tokens (causal attention over the earlier context), usually compute-bound.
By default the tensor-parallel size is the smallest of 1, 2, 4, 8 whose memory holds the weights plus
a KV budget; KV capacity is what remains.

Layouts (`layout=`): a replica of n = tp x dp_attention GPUs may run attention data-parallel (each of
dp_attention groups holds its own tp-sharded copy of the attention / dense weights and its share of the
batch's KV) with the routed experts spread over all n GPUs (expert parallel); the MoE layer then costs an
all-to-all (dispatch + combine of each token's k expert copies) instead of the TP all-reduce.
`layout="cheapest"` tries TP 1-8 and, for MoE, attention-DP + EP layouts, and keeps the one with the lowest
$/Mtoken at the operating point the workload's `ServingLoad` makes it reach (the batch its KV holds of the
workload's requests, up to the engine's running cap per DP rank; prefill charged per DP rank), not the
smallest that fits.

Backends (`backend=`): "roofline" (this formula), "aiconfigurator" (measured step tables from NVIDIA's
aiconfigurator-core, costmodel/steptime/measured.py; refused where its support matrix does not reach) and "auto"
(measured where covered, else the roofline). The replica says which priced it (`backend`,
`backend_source`). Pure functions of numbers: every function accepts numpy arrays for batch and context
(broadcast) so the planner can evaluate curves at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.specs.catalog import TP_SIZES, Accelerator, Catalog, KVDtype, Precision, load_catalog
from mixfleet.costmodel.specs.model import ModelSpec, load_model_spec
from mixfleet.costmodel.steptime.measured import DEFAULT_ENGINES, Layout, NotCovered, StepTable, step_table

ACT_BYTES = 2                     # bytes per activation element in TP all-reduces (BF16)
DEFAULT_MAX_BATCH = 256           # engine cap on running requests per replica (SGLang-like)
BACKENDS = ("roofline", "aiconfigurator", "auto")

ArrayLike = float | int | np.ndarray


class FitError(SpecError):
    """Nothing fits: the message gives the bytes needed and available."""


@dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Overrides of the catalog's efficiency factors (calibration fills these). None = catalog default."""

    eff_bw: float | None = None              # achieved / peak memory bandwidth, (0, 2]
    eff_flops: float | None = None           # achieved / peak FLOP/s, (0, 2]
    decode_overhead_s: float | None = None   # fixed seconds per decode step, >= 0
    prefill_overhead_s: float | None = None  # fixed seconds per prefill call, >= 0
    emulation_slowdown: float | None = None  # step-time multiplier when emulated, >= 1
    trainer_mfu: float | None = None         # trainer model FLOP utilization, (0, 1]
    trainer_overhead_s: float | None = None  # fixed seconds per trainer update, >= 0

    def __post_init__(self) -> None:
        bounds = {"eff_bw": (0.0, 2.0, True), "eff_flops": (0.0, 2.0, True), "decode_overhead_s": (0.0, 60.0, False),
                  "prefill_overhead_s": (0.0, 60.0, False), "emulation_slowdown": (1.0, 100.0, False),
                  "trainer_mfu": (0.0, 1.0, True), "trainer_overhead_s": (0.0, 3600.0, False)}
        for name, (lo, hi, lo_open) in bounds.items():
            v = getattr(self, name)
            if v is None:
                continue
            ok = isinstance(v, int | float) and not isinstance(v, bool) and (v > lo if lo_open else v >= lo) and v <= hi
            if not ok:
                raise SpecError("efficiency", name, v, f"None or a number in {'(' if lo_open else '['}{lo}, {hi}]")

    def over(self, base: Efficiency) -> Efficiency:
        """These overrides on top of `base` (fields set here win)."""
        set_here = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return replace(base, **set_here)


def _eff(value: float | None, default: float) -> float:
    return default if value is None else float(value)


def expert_coverage(num_experts: int, active_experts: int, tokens: ArrayLike) -> ArrayLike:
    """Expected distinct experts touched in one MoE layer by `tokens` tokens under uniform top-k routing."""
    e, k = float(num_experts), float(active_experts)
    t = np.asarray(tokens, dtype=np.float64)
    out = e * (1.0 - (1.0 - k / e) ** t)
    return float(out) if out.ndim == 0 else out


def _out(x: np.ndarray) -> ArrayLike:
    return float(x) if np.ndim(x) == 0 else x


@dataclass(frozen=True, kw_only=True)
class ServingLoad:
    """What a workload asks of one busy replica, the point its operating point and layout are taken at: the
    mean decode context of its running requests, the KV tokens each holds (its context and reply), the tokens
    each prefills and the tokens it generates after that prefill, and the engine's running-request cap per
    attention-DP rank (each rank runs its own scheduler). The batch it reaches is what the KV holds of such
    requests, up to that cap."""
    context: float                       # mean decode context of the running requests, tokens
    kv_per_request: float                # KV tokens one running request holds
    prefill_tokens: float = 0.0          # tokens prefilled per request (per turn), 0: decode only
    reply_tokens: float = 1.0            # tokens generated per prefill
    max_running: int = DEFAULT_MAX_BATCH  # the engine's running-request cap per attention-DP rank

    def __post_init__(self) -> None:
        for name in ("context", "kv_per_request", "reply_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (v > 0 and math.isfinite(v)):
                raise SpecError("serving load", name, v, "a number > 0")
        v = self.prefill_tokens
        if isinstance(v, bool) or not isinstance(v, int | float) or not (v >= 0 and math.isfinite(v)):
            raise SpecError("serving load", "prefill_tokens", v, "a number >= 0")
        if isinstance(self.max_running, bool) or not isinstance(self.max_running, int) or self.max_running < 1:
            raise SpecError("serving load", "max_running", self.max_running, "an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class OperatingPoint:
    """A replica under a `ServingLoad` (`ReplicaModel.operating_point`)."""
    batch: float                         # running requests: what the KV holds, up to the cap (>= 1)
    decode_tokens_per_s: float           # generated tokens/s of the replica's decode steps at that batch
    prefill_s: float                     # one request's prefill, as the replica's timeline pays it
    tokens_per_s: float                  # generated tokens/s with the prefill charged per request
    tokens_per_s_per_gpu: float
    usd_per_mtoken: float


def cheapest(replicas: list[ReplicaModel], load: ServingLoad) -> int:
    """Index of the replica with the lowest USD per generated token at `load`'s operating point (the first
    among equals): the one layout choice of `replica_model(layout="cheapest")` and the planner."""
    costs = [r.operating_point(load).usd_per_mtoken for r in replicas]
    return min(range(len(costs)), key=costs.__getitem__)


@dataclass(frozen=True, kw_only=True)
class ReplicaModel:
    """One sampler replica: a model on `tp` GPUs of one accelerator in one precision and KV dtype.

    Build it with `replica_model(...)`. Byte counts are for the whole replica (all TP ranks).
    """

    model: ModelSpec
    accelerator: Accelerator
    precision: Precision
    kv_dtype: KVDtype
    tp: int                              # GPUs per replica (tensor parallel)
    emulated: bool                       # the precision runs emulated (slower) on this accelerator
    eff_bw: float
    eff_flops: float
    decode_overhead_s: float
    prefill_overhead_s: float
    slowdown: float                      # emulation_slowdown if emulated else 1.0
    kv_budget_tokens: int                # KV tokens the fit reserved room for
    # derived constants (filled by replica_model)
    weight_bytes: float                  # all weights, quantized + high-precision, whole replica
    quant_bytes_per_weight: float
    keep_bytes_per_weight: float
    kv_bytes_per_token: float            # whole replica, incl. KV heads replicated when tp > kv heads
    kv_capacity_tokens: int              # KV tokens the replica can hold
    peak_flops_per_s: float              # per GPU, in the precision's compute (or emulation) format
    bw_bytes_per_s: float                # per GPU
    # layout: n_gpus = tp x dp_attention; experts over ep of them (defaults: plain TP, today's model)
    dp_attention: int = 1                # attention data-parallel groups, each tp GPUs
    ep: int = 1                          # expert-parallel size (1 = experts tensor-parallel)
    # which backend prices the step times: "roofline" or "aiconfigurator" (then `measured` holds its table)
    backend: str = "roofline"
    backend_source: str = ""             # the measured table's source, or why the roofline priced it
    measured: StepTable | None = None

    # ---- names --------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """'H100-fp8' style label."""
        return f"{self.accelerator.name}-{self.precision.name}"

    @property
    def n_gpus(self) -> int:
        return self.tp * self.dp_attention

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, dp_attention=self.dp_attention, ep=self.ep)

    @property
    def key(self) -> tuple[Any, ...]:
        """Hashable identity (model, accelerator, precision, KV dtype, tp, emulated[, layout, backend])."""
        base = (self.model.name, self.accelerator.name, self.precision.name, self.kv_dtype.name, self.tp, self.emulated)
        if self.dp_attention == 1 and self.ep == 1 and self.backend == "roofline":
            return base
        return (*base, self.dp_attention, self.ep, self.backend)

    # ---- memory ---------------------------------------------------------------------------------
    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.weight_bytes / self.n_gpus

    def max_batch(self, mean_context: ArrayLike, cap: int = DEFAULT_MAX_BATCH) -> ArrayLike:
        """Most concurrent sequences of `mean_context` tokens the KV cache holds (capped at `cap`)."""
        ctx = np.maximum(np.asarray(mean_context, dtype=np.float64), 1.0)
        return _out(np.minimum(np.floor(self.kv_capacity_tokens / ctx), cap))

    # ---- time -----------------------------------------------------------------------------------
    def _static_bytes(self) -> float:
        """Weights read every decode step regardless of routing: attention, dense FFN, router, LM head."""
        m = self.model
        q = (m.attention_params_per_layer + m.dense_ffn_params_per_layer) * m.num_layers * self.quant_bytes_per_weight
        if m.moe is not None:
            q += m.num_layers * m.moe.shared_experts * m.expert_params * self.quant_bytes_per_weight
            q += m.num_layers * m.hidden_size * m.moe.num_experts * self.keep_bytes_per_weight  # router
        return q + m.vocab_size * m.hidden_size * self.keep_bytes_per_weight  # LM head

    def _expert_bytes(self, tokens: np.ndarray) -> np.ndarray:
        m = self.model
        if m.moe is None:
            return np.zeros_like(tokens)
        touched = np.asarray(expert_coverage(m.moe.num_experts, m.moe.active_experts, tokens))
        return m.num_layers * touched * m.expert_params * self.quant_bytes_per_weight

    def _attn_flops_per_key(self) -> float:
        """FLOPs per (query token, key) pair, all layers: QK^T and AV, 2 each per head dim."""
        m = self.model
        return 4.0 * m.num_layers * m.num_attention_heads * m.head_dim

    def _comm_s(self, tokens: np.ndarray) -> np.ndarray:
        """Two ring all-reduces per layer of the tokens' hidden states over the scale-up link (plain TP); with
        attention DP + EP: one all-reduce per layer inside each TP group (if tp > 1) on its share of the
        tokens, and the MoE all-to-all: each token's k expert copies dispatched and combined."""
        m, acc = self.model, self.accelerator
        if self.dp_attention == 1 or m.moe is None:
            if self.tp == 1:
                return np.zeros_like(tokens)
            size = tokens * m.hidden_size * ACT_BYTES
            per = 2.0 * (self.tp - 1) / self.tp * size / (acc.link_gb_s * 1e9) + acc.link_latency_s
            return 2.0 * m.num_layers * per
        n = self.n_gpus
        out = np.zeros_like(tokens)
        if self.tp > 1:
            size = tokens / self.dp_attention * m.hidden_size * ACT_BYTES
            out = out + m.num_layers * (2.0 * (self.tp - 1) / self.tp * size / (acc.link_gb_s * 1e9)
                                        + acc.link_latency_s)
        sent = tokens / n * m.moe.active_experts * m.hidden_size * ACT_BYTES * (n - 1) / n  # per GPU, one way
        return out + 2.0 * m.num_layers * (sent / (acc.link_gb_s * 1e9) + acc.link_latency_s)

    def _bytes_per_gpu(self, static: float, varying: np.ndarray) -> np.ndarray:
        """Per-GPU bytes: attention / dense weights split over a TP group, everything else over all GPUs."""
        if self.dp_attention == 1:
            return (static + varying) / self.tp
        return static / self.tp + varying / self.n_gpus

    def decode_bytes(self, batch: ArrayLike, mean_context: ArrayLike) -> ArrayLike:
        """Bytes read + written by one decode step of `batch` sequences at `mean_context` tokens."""
        b = np.asarray(batch, dtype=np.float64)
        ctx = np.asarray(mean_context, dtype=np.float64)
        emb_rows = b * self.model.hidden_size * self.keep_bytes_per_weight
        return _out(self._static_bytes() + self._expert_bytes(b) + emb_rows + b * (ctx + 1.0) * self.kv_bytes_per_token)

    def decode_flops(self, batch: ArrayLike, mean_context: ArrayLike) -> ArrayLike:
        b = np.asarray(batch, dtype=np.float64)
        ctx = np.asarray(mean_context, dtype=np.float64)
        return _out(2.0 * self.model.active_params * b + self._attn_flops_per_key() * b * (ctx + 1.0))

    def decode_step_s(self, batch: ArrayLike, mean_context: ArrayLike) -> ArrayLike:
        """Seconds for one decode step (one token for each of `batch` sequences at `mean_context`)."""
        b = np.asarray(batch, dtype=np.float64)
        if self.measured is not None:
            return _out(self.measured.decode(b, mean_context))
        if self.dp_attention == 1:
            mem_s = np.asarray(self.decode_bytes(b, mean_context)) / (self.tp * self.bw_bytes_per_s * self.eff_bw)
        else:
            varying = np.asarray(self.decode_bytes(b, mean_context)) - self._static_bytes()
            mem_s = self._bytes_per_gpu(self._static_bytes(), varying) / (self.bw_bytes_per_s * self.eff_bw)
        cmp_s = np.asarray(self.decode_flops(b, mean_context)) / (self.n_gpus * self.peak_flops_per_s * self.eff_flops)
        step = np.maximum(mem_s, cmp_s) + self._comm_s(b) + self.decode_overhead_s
        return _out(step * self.slowdown)

    def tokens_per_s(self, batch: ArrayLike, mean_context: ArrayLike) -> ArrayLike:
        """Generated tokens per second of the replica at a steady batch and mean context."""
        b = np.asarray(batch, dtype=np.float64)
        return _out(b / np.asarray(self.decode_step_s(b, mean_context)))

    def prefill_s(self, new_tokens: ArrayLike, context_before: ArrayLike = 0) -> ArrayLike:
        """Seconds of the forward that prefills `new_tokens` tokens after `context_before` cached tokens: one
        request on a plain-TP replica; with attention DP, one such request on every DP rank at once (each rank
        prefills its own requests, the MoE layers see all ranks' tokens), as aiconfigurator's per-rank prefill
        latency is. What one request costs the replica's timeline is `replica_prefill_s`."""
        n = np.asarray(new_tokens, dtype=np.float64)
        c = np.asarray(context_before, dtype=np.float64)
        if self.measured is not None:
            return _out(self.measured.prefill(n, c))
        keys = n * c + n * (n + 1.0) / 2.0
        flops = 2.0 * self.model.active_params * n + self._attn_flops_per_key() * keys
        rows = n * self.model.hidden_size * self.keep_bytes_per_weight
        if self.dp_attention == 1:
            varying = self._expert_bytes(n) + (c + n) * self.kv_bytes_per_token + rows
            byts_gpu = (self._static_bytes() + varying) / self.tp
            flops_gpu = flops / self.tp
            comm = self._comm_s(n)
        else:  # each of the dp ranks prefills one request on its tp GPUs; every rank's experts over all GPUs
            d = float(self.dp_attention)
            varying = self._expert_bytes(d * n) + d * ((c + n) * self.kv_bytes_per_token + rows)
            byts_gpu = self._bytes_per_gpu(self._static_bytes(), varying)
            flops_gpu = d * flops / self.n_gpus        # = one request's FLOPs over its rank's tp GPUs
            comm = self._comm_s(d * n)
        t = np.maximum(byts_gpu / (self.bw_bytes_per_s * self.eff_bw),
                       flops_gpu / (self.peak_flops_per_s * self.eff_flops))
        t = (t + comm + self.prefill_overhead_s) * self.slowdown
        return _out(np.where(n > 0, t, 0.0))

    def replica_prefill_s(self, new_tokens: ArrayLike, context_before: ArrayLike = 0) -> ArrayLike:
        """Seconds one request's prefill takes from the replica's timeline: `prefill_s`, and under attention DP
        `prefill_s / dp_attention` (the engines prefill each DP rank's requests in the same forward as the other
        ranks', so a busy replica prefills dp requests per forward; aiconfigurator's aggregated estimate runs a
        rank's own batch and multiplies its throughput by dp). The twin stalls a replica for this long per
        admitted request, and the planner and the published-figures comparison charge it per request."""
        t = self.prefill_s(new_tokens, context_before)
        return t if self.dp_attention == 1 else _out(np.asarray(t, dtype=np.float64) / self.dp_attention)

    # ---- price ----------------------------------------------------------------------------------
    @property
    def price_usd_per_hour(self) -> float:
        """Replica price: GPUs x the catalog price table's USD per GPU-hour."""
        return self.n_gpus * self.accelerator.price_usd_per_gpu_hour

    def usd_per_mtoken(self, batch: ArrayLike, mean_context: ArrayLike) -> ArrayLike:
        """USD per million generated tokens at a steady batch and mean context."""
        tps = np.asarray(self.tokens_per_s(batch, mean_context))
        return _out(self.price_usd_per_hour / 3600.0 / tps * 1e6)

    @property
    def cold_start_s(self) -> float:
        """Container/engine start + loading this replica's weights (each GPU loads its shard in parallel)."""
        return self.accelerator.cold_start_s + self.weight_bytes_per_gpu / (self.accelerator.load_gb_s * 1e9)

    def best_operating_point(self, mean_context: float, cap: int = DEFAULT_MAX_BATCH) -> dict[str, float]:
        """The batch (<= KV capacity and `cap`) with the lowest $/Mtoken at `mean_context`: batch, tokens/s, $/Mtok."""
        bmax = int(self.max_batch(mean_context, cap))
        if bmax < 1:
            return {"batch": 0, "tokens_per_s": 0.0, "usd_per_mtoken": math.inf}
        b = np.arange(1, bmax + 1, dtype=np.float64)
        cost = np.asarray(self.usd_per_mtoken(b, mean_context))
        i = int(np.argmin(cost))
        return {"batch": int(b[i]), "tokens_per_s": float(b[i] / self.decode_step_s(b[i], mean_context)),
                "usd_per_mtoken": float(cost[i])}

    def operating_point(self, load: ServingLoad) -> OperatingPoint:
        """The replica busy with `load`: the batch it reaches (KV capacity / KV per request, clipped to 1 ..
        the running cap x dp_attention), its decode throughput there at `load.context`, and its throughput with
        each request's prefill charged as the replica pays it (`replica_prefill_s`, per attention-DP rank):
        1 / (1 / decode + prefill / reply). The planner's busy throughput and the layout choice use this."""
        b = float(np.clip(self.kv_capacity_tokens / load.kv_per_request, 1.0, load.max_running * self.dp_attention))
        tps = float(self.tokens_per_s(b, load.context))
        pf = float(self.replica_prefill_s(load.prefill_tokens))
        eff = 1.0 / (1.0 / tps + pf / load.reply_tokens)
        return OperatingPoint(batch=b, decode_tokens_per_s=tps, prefill_s=pf, tokens_per_s=eff,
                              tokens_per_s_per_gpu=eff / self.n_gpus,
                              usd_per_mtoken=self.price_usd_per_hour / 3600.0 / eff * 1e6)

    def summary(self) -> dict[str, Any]:
        """Plain-JSON facts about the replica (for CLI --json and run-log headers)."""
        return {"accelerator": self.accelerator.name, "precision": self.precision.name,
                "kv_dtype": self.kv_dtype.name, "tp": self.tp, "dp_attention": self.dp_attention, "ep": self.ep,
                "n_gpus": self.n_gpus, "layout": self.layout.label, "backend": self.backend,
                "backend_source": self.backend_source, "emulated": self.emulated,
                "weight_gb": self.weight_bytes / 1e9, "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_capacity_tokens": self.kv_capacity_tokens, "price_usd_per_hour": self.price_usd_per_hour,
                "price_estimate": self.accelerator.price_estimate, "cold_start_s": self.cold_start_s,
                "eff_bw": self.eff_bw, "eff_flops": self.eff_flops, "decode_overhead_s": self.decode_overhead_s,
                "slowdown": self.slowdown}


# ---- building a replica model ------------------------------------------------------------------

def _weight_parts(model: ModelSpec, precision: Precision) -> tuple[float, float]:
    """(attention + dense FFN + shared experts + router + embeddings / LM head, routed experts) bytes."""
    m = model
    linear = (m.attention_params_per_layer + m.dense_ffn_params_per_layer) * m.num_layers
    keep = m.embedding_params
    experts = 0.0
    if m.moe is not None:
        linear += m.num_layers * m.expert_params * m.moe.shared_experts
        experts = m.num_layers * m.expert_params * m.moe.num_experts * precision.bytes_per_weight
        keep += m.num_layers * m.hidden_size * m.moe.num_experts
    return linear * precision.bytes_per_weight + keep * precision.keep_bytes_per_weight, experts


def weight_bytes(model: ModelSpec, precision: Precision, dp_attention: int = 1) -> float:
    """All weights of one replica in `precision`: linear layers quantized, embeddings / LM head / router kept;
    with attention data parallelism each of the `dp_attention` groups holds its own copy of the non-expert part."""
    dense, experts = _weight_parts(model, precision)
    return dense * dp_attention + experts


def kv_bytes_per_token(model: ModelSpec, kv_dtype: KVDtype, tp: int = 1) -> float:
    """KV bytes per token for the whole replica; KV heads are replicated when tp exceeds their count."""
    stored_heads = max(model.num_kv_heads, tp * math.ceil(model.num_kv_heads / tp)) if tp > 1 else model.num_kv_heads
    return 2.0 * model.num_layers * stored_heads * model.head_dim * kv_dtype.bytes_per_element


def kv_capacity_tokens(model: ModelSpec, accelerator: Accelerator, precision: Precision, kv_dtype: KVDtype,
                       tp: int, dp_attention: int = 1) -> int:
    """KV tokens left on tp x dp_attention GPUs after the engine's memory share, the per-GPU reserve and the
    weights (a token's KV lives in one attention group, heads replicated there when tp exceeds them)."""
    n = tp * dp_attention
    usable = n * (accelerator.memory_bytes * accelerator.mem_util - accelerator.reserve_gb * 1e9)
    free = usable - weight_bytes(model, precision, dp_attention)
    return max(0, int(free // kv_bytes_per_token(model, kv_dtype, tp)))


def candidate_layouts(model: ModelSpec, max_gpus: int) -> list[Layout]:
    """Layouts `layout="cheapest"` tries: TP 1, 2, 4, 8 and, for MoE, attention DP + expert parallel over the
    same GPUs (DEP n, and TP 2 x DP n/2 with EP n from 4 GPUs)."""
    out: list[Layout] = []
    for n in (t for t in TP_SIZES if t <= max_gpus):
        out.append(Layout(tp=n))
        if model.moe is not None and n > 1:
            out.append(Layout(tp=1, dp_attention=n, ep=n))
            if n >= 4:
                out.append(Layout(tp=2, dp_attention=n // 2, ep=n))
    return out


def _as_layout(layout: Layout | str | None, tp: int | None) -> Layout | str | None:
    if layout is None or isinstance(layout, Layout):
        return layout
    if layout in ("smallest", "cheapest"):
        return layout
    raise SpecError("replica", "layout", layout, "None, 'smallest', 'cheapest' or a Layout(tp, dp_attention, ep)")


def replica_model(model: ModelSpec | str, accelerator: Accelerator | str, precision: Precision | str,
                  kv_dtype: KVDtype | str = "fp8_e4m3", *, catalog: Catalog | None = None, tp: int | None = None,
                  emulated: bool = False, efficiency: Efficiency | None = None,
                  kv_budget_tokens: int | None = None, layout: Layout | str | None = None,
                  mean_context: float | None = None, max_batch: int = DEFAULT_MAX_BATCH,
                  backend: str = "roofline", engine: str | tuple[str, ...] = DEFAULT_ENGINES,
                  load: ServingLoad | None = None) -> ReplicaModel:
    """Build the cost model of one replica.

    tp=None picks the smallest of 1, 2, 4, 8 (up to the accelerator's max_tp) whose memory holds the
    weights plus `kv_budget_tokens` of KV (default: one sequence of the model's max context); a FitError
    gives the numbers when none does. A precision the accelerator cannot run natively is refused unless
    `emulated=True` (then every step is `emulation_slowdown` times slower).

    `layout`: None / "smallest" (the rule above, plain TP), a `Layout(tp, dp_attention, ep)`, or "cheapest":
    every candidate layout that fits, priced at the operating point `load` makes it reach (`operating_point`:
    the batch its KV holds of the load's requests up to the load's running cap per attention-DP rank, prefill
    charged per rank), lowest $/Mtoken wins (`cheapest`); without a load, decode only at `mean_context`
    (default: a quarter of the KV budget), requests of that many KV tokens, `max_batch` per rank.
    `max_batch` also bounds the measured backend's table (per rank; raised to the load's cap). `backend`: "roofline",
    "aiconfigurator" (refused with the reason where not covered) or "auto" (measured where covered); `engine`
    is the measured backend's serving engine (sglang, trtllm, vllm), or engines to try in order (default:
    SGLang's tables, then TensorRT-LLM's where SGLang's database lacks the shape).
    """
    cat = catalog if catalog is not None else load_catalog()
    m = load_model_spec(model) if isinstance(model, str) else model
    acc, prec, kv = cat.accelerator(accelerator), cat.precision(precision), cat.kv_dtype(kv_dtype)
    where = f"replica {m.name} on {acc.name}/{prec.name}"
    if backend not in BACKENDS:
        raise SpecError(where, "backend", backend, BACKENDS)
    support = cat.support(acc, prec)
    if support == "unsupported":
        raise SpecError(where, "precision", prec.name,
                        f"a precision {acc.name} ({acc.arch}) can run: "
                        + ", ".join(p for p in cat.precisions if cat.support(acc, p) != "unsupported"))
    if support == "emulated" and not emulated:
        native = ", ".join(p for p in cat.precisions if cat.support(acc, p) == "native") or "none"
        raise SpecError(where, "emulated", False,
                        f"True to emulate {prec.name} on {acc.name} ({acc.arch}: no native support, "
                        f"{prec.emulation_slowdown:g}x slower), or a native precision: {native}")
    is_emulated = support == "emulated"
    budget = m.max_context if kv_budget_tokens is None else int(kv_budget_tokens)
    if budget < 0:
        raise SpecError(where, "kv_budget_tokens", budget, "an integer >= 0")
    lay = _as_layout(layout, tp)
    table_batch = max(max_batch, load.max_running) if load is not None else max_batch
    eff = (efficiency or Efficiency()).over(Efficiency(
        eff_bw=acc.eff_bw, eff_flops=acc.eff_flops, decode_overhead_s=acc.decode_overhead_s,
        prefill_overhead_s=acc.prefill_overhead_s, emulation_slowdown=prec.emulation_slowdown))
    peak = acc.emulation_tflops if is_emulated else acc.peak_tflops(prec.compute)

    def build(t: int, dp: int = 1, ep: int = 1) -> ReplicaModel:
        rm = ReplicaModel(
            model=m, accelerator=acc, precision=prec, kv_dtype=kv, tp=t, emulated=is_emulated,
            eff_bw=eff.eff_bw, eff_flops=eff.eff_flops, decode_overhead_s=eff.decode_overhead_s,
            prefill_overhead_s=eff.prefill_overhead_s, slowdown=eff.emulation_slowdown if is_emulated else 1.0,
            kv_budget_tokens=budget, weight_bytes=weight_bytes(m, prec, dp),
            quant_bytes_per_weight=prec.bytes_per_weight, keep_bytes_per_weight=prec.keep_bytes_per_weight,
            kv_bytes_per_token=kv_bytes_per_token(m, kv, t),
            kv_capacity_tokens=kv_capacity_tokens(m, acc, prec, kv, t, dp),
            peak_flops_per_s=peak * 1e12, bw_bytes_per_s=acc.bandwidth_bytes_per_s, dp_attention=dp, ep=ep)
        if backend == "roofline":
            return rm
        engines = (engine,) if isinstance(engine, str) else tuple(engine)
        err: NotCovered | None = None
        for eng in engines:
            try:
                table = step_table(m, acc, prec, kv, layout=rm.layout, engine=eng, emulated=is_emulated,
                                   max_batch=max(table_batch * dp, 2), max_context=max(budget, 2))
            except NotCovered as e:
                err = err or e
                continue
            return replace(rm, backend="aiconfigurator", backend_source=table.source, measured=table)
        if backend == "aiconfigurator" and err is not None:
            raise err
        why = err.allowed if err is not None else "no engine"
        return replace(rm, backend_source=f"roofline: not covered by the measured backend ({why})")

    if isinstance(lay, Layout):
        if lay.gpus > acc.max_tp or lay.tp not in TP_SIZES:
            raise SpecError(where, "layout", lay.label, f"at most {acc.max_tp} GPUs, tp in {TP_SIZES}")
        if m.moe is None and (lay.dp_attention > 1 or lay.ep > 1):
            raise SpecError(where, "layout", lay.label, "plain TP for a dense model (attention DP needs experts)")
        if kv_capacity_tokens(m, acc, prec, kv, lay.tp, lay.dp_attention) < budget:
            raise _no_fit(where, m, acc, prec, kv, budget, lay.tp, lay.label, lay.dp_attention)
        return build(lay.tp, lay.dp_attention, lay.ep)

    candidates = [t for t in TP_SIZES if t <= acc.max_tp]
    if tp is not None:
        if tp not in TP_SIZES or tp > acc.max_tp:
            raise SpecError(where, "tp", tp, [t for t in candidates])
        candidates = [tp]
    if lay == "cheapest":
        fits = [c for c in candidate_layouts(m, acc.max_tp) if (tp is None or c.gpus == tp)
                and kv_capacity_tokens(m, acc, prec, kv, c.tp, c.dp_attention) >= budget]
        if not fits:
            raise _no_fit(where, m, acc, prec, kv, budget, candidates[-1], tp if tp is not None else f"1..{acc.max_tp}")
        ctx = float(mean_context) if mean_context is not None else max(1.0, budget / 4.0)
        at = load if load is not None else ServingLoad(context=ctx, kv_per_request=ctx, max_running=max_batch)
        priced = [build(c.tp, c.dp_attention, c.ep) for c in fits]
        return priced[cheapest(priced, at)]
    chosen = next((t for t in candidates if kv_capacity_tokens(m, acc, prec, kv, t) >= budget), None)
    if chosen is None:
        raise _no_fit(where, m, acc, prec, kv, budget, candidates[-1], tp if tp is not None else f"1..{acc.max_tp}")
    return build(chosen)


def _no_fit(where: str, m: ModelSpec, acc: Accelerator, prec: Precision, kv: KVDtype, budget: int, t: int,
            asked: Any, dp: int = 1) -> FitError:
    wgb = weight_bytes(m, prec, dp) / 1e9
    kvgb = budget * kv_bytes_per_token(m, kv, t) / 1e9
    per_gpu = acc.memory_gb * acc.mem_util - acc.reserve_gb
    return FitError(where, "tp", asked,
                    f"a size whose memory holds weights {wgb:.1f} GB + KV {kvgb:.1f} GB "
                    f"({budget} tokens of {kv.name}) = {wgb + kvgb:.1f} GB; {acc.name} gives {per_gpu:.1f} GB "
                    f"usable per GPU, {t * dp * per_gpu:.1f} GB at {t * dp} GPUs")


# ---- trainer and weight sync -------------------------------------------------------------------

def trainer_step_s(model: ModelSpec, accelerator: Accelerator, n_gpus: int, tokens: ArrayLike, *,
                   mfu: float | None = None, overhead_s: float | None = None,
                   efficiency: Efficiency | None = None) -> ArrayLike:
    """Seconds for one trainer update over `tokens` tokens: 6 * active_params * tokens / (n * peak * MFU) + overhead.

    Peak is the accelerator's BF16 (FP32 on the CPU). `mfu` / `overhead_s` override `efficiency`, which
    overrides the catalog defaults.
    """
    if isinstance(n_gpus, bool) or not isinstance(n_gpus, int) or n_gpus < 1:
        raise SpecError("trainer", "n_gpus", n_gpus, "a positive integer")
    eff = efficiency or Efficiency()
    mfu_v = mfu if mfu is not None else _eff(eff.trainer_mfu, accelerator.trainer_mfu)
    over_s = overhead_s if overhead_s is not None else _eff(eff.trainer_overhead_s, accelerator.trainer_overhead_s)
    Efficiency(trainer_mfu=mfu_v, trainer_overhead_s=over_s)  # validates
    peak = accelerator.emulation_tflops * 1e12
    t = np.asarray(tokens, dtype=np.float64)
    return _out(6.0 * model.active_params * t / (n_gpus * peak * mfu_v) + over_s)


def weight_sync_s(dst: ReplicaModel, src: Accelerator | None = None, *, network_gb_s: float | None = None,
                  efficiency: Efficiency | None = None) -> float:
    """Seconds to bring new BF16 weights from the trainer to one replica and convert them to its precision.

    Transfer: each of the replica's GPUs receives its BF16 shard at min(src, dst) network bandwidth (or
    `network_gb_s`); requantization: `precision.requant_passes` memory passes over the BF16 shard.
    """
    m = dst.model
    bf16_bytes = (m.total_params - 0) * 2.0
    shard = bf16_bytes / dst.n_gpus
    bw = network_gb_s if network_gb_s is not None else min(
        dst.accelerator.network_gb_s, src.network_gb_s if src is not None else math.inf)
    if not bw > 0:
        raise SpecError("weight sync", "network_gb_s", bw, "a positive number")
    transfer_s = shard / (bw * 1e9)
    eff_bw = dst.eff_bw if efficiency is None or efficiency.eff_bw is None else efficiency.eff_bw
    requant_s = dst.precision.requant_passes * shard / (dst.bw_bytes_per_s * eff_bw)
    return float(transfer_s + requant_s)
