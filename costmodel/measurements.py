"""Published GPU serving measurements (data/measurements/*.toml) and the cost model held against them.

Each file is one source (a `[source]` table: publisher, document, url, version, date, method) and its
`[[rows]]`, one per published figure: GPU, GPU count and layout (tp, dp_attention, ep, pp), weight and KV
precision, model (a spec name in data/models, plus the checkpoint's hf_id), engine and version, ISL / OSL
(with the random-length ratio where the benchmark draws lengths), concurrency (0 = offline maximum
throughput), the metric as the source defines it and its value.

`predict(row, backend)` prices the row's exact setup with one replica of the cost model (roofline or the
measured aiconfigurator backend, same layout, lengths and concurrency):

    cycle = (c / dp_attention) * prefill(ISL) + OSL * decode_step(c, ISL + OSL / 2)
    output tokens/s per GPU = c * OSL / cycle / GPUs          (prefill charged to the same GPUs)
    TPOT = decode_step(c, ISL + OSL / 2)

where c is the concurrency or, for offline maximum-throughput rows, the largest batch the replica's KV
holds at ISL + OSL tokens (at most `OFFLINE_MAX_BATCH` per attention-DP group). `compare(...)` gives per
row predicted / published and the median and worst factor (max(p/m, m/p)) per backend, accelerator,
precision and source. Pure numpy; aiconfigurator is reached only through costmodel/measured.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mixfleet.costmodel.catalog import Catalog, load_catalog
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.measured import Layout, NotCovered
from mixfleet.costmodel.model import ModelSpec, known_models, load_model_spec
from mixfleet.costmodel.paths import data_path
from mixfleet.costmodel.roofline import Efficiency, FitError, ReplicaModel, replica_model
from mixfleet.costmodel.tomlread import check_keys, get_float, get_int, get_str, get_table, read_toml

METRICS = ("output_tokens_per_s_per_gpu", "tpot_ms")
ENGINES = ("sglang", "trtllm", "vllm")
KV_CHOICES = ("auto", "bf16", "fp8_e4m3")
OFFLINE_MAX_BATCH = 2048            # per attention-DP group: the engines' largest CUDA-graph batch in these runs
_ROW_KEYS = ("section", "model", "hf_id", "gpu", "layout", "gpus", "tp", "dp_attention", "ep", "pp", "precision",
             "precision_source", "kv_dtype", "engine", "engine_version", "isl", "osl", "concurrency",
             "random_range_ratio", "metric", "value", "date", "note")
_SOURCE_KEYS = ("id", "publisher", "title", "url", "version", "date", "method", "concurrency", "kv_note")


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """One published figure and the setup it was measured in."""

    source: str                    # source id (the file's [source].id)
    source_title: str
    url: str
    section: str
    date: str
    model: str                     # spec name in data/models ("" or an unknown name: no spec fits)
    hf_id: str
    gpu: str                       # catalog accelerator name
    gpus: int
    tp: int
    dp_attention: int
    ep: int
    pp: int
    precision: str
    precision_source: str
    kv_dtype: str                  # auto | bf16 | fp8_e4m3
    engine: str
    engine_version: str
    isl: int
    osl: int
    concurrency: int               # 0 = offline max throughput
    random_range_ratio: float      # lengths uniform in [r L, L]; 1 = fixed
    metric: str
    value: float
    note: str = ""
    index: int = 0                 # row number in its file

    @property
    def key(self) -> str:
        return f"{self.source}#{self.index}"

    @property
    def layout(self) -> Layout:
        return Layout(tp=self.tp, dp_attention=self.dp_attention, ep=self.ep)

    @property
    def mean_isl(self) -> float:
        return self.isl * (1.0 + self.random_range_ratio) / 2.0

    @property
    def mean_osl(self) -> float:
        return self.osl * (1.0 + self.random_range_ratio) / 2.0

    @property
    def kv(self) -> str:
        """The KV dtype to price: 'auto' is the checkpoint's own (FP8 KV scales ship with ModelOpt FP8 / FP4
        checkpoints; BF16 otherwise)."""
        if self.kv_dtype != "auto":
            return self.kv_dtype
        return "fp8_e4m3" if self.precision in ("fp8", "nvfp4") and self.engine == "trtllm" else "bf16"

    @property
    def regime(self) -> str:
        """'latency' (concurrency <= 16: the step is weights-bound) or 'throughput' (large batch, offline)."""
        return "latency" if 0 < self.concurrency <= 16 else "throughput"


def load_measurements(path: str | Path | None = None, catalog: Catalog | None = None) -> list[Measurement]:
    """Every row of every *.toml in `path` (a folder or one file; default: the shipped data/measurements)."""
    cat = catalog or load_catalog()
    p = Path(path) if path is not None else data_path("measurements")
    files = sorted(p.glob("*.toml")) if p.is_dir() else [p]
    if not files:
        raise SpecError(str(p), "<folder>", "no *.toml", "a folder of measurement files")
    out: list[Measurement] = []
    seen: set[str] = set()
    for f in files:
        raw = read_toml(f)
        where = str(f)
        check_keys(where, raw, ("schema", "source", "rows"))
        get_int(where, raw, "schema", lo=1, hi=1)
        src = get_table(where, raw, "source")
        check_keys(f"{where} [source]", src, _SOURCE_KEYS)
        sid = get_str(f"{where} [source]", src, "id")
        if sid in seen:
            raise SpecError(where, "source.id", sid, "an id no other measurement file uses")
        seen.add(sid)
        rows = raw.get("rows")
        if not isinstance(rows, list) or not rows:
            raise SpecError(where, "rows", rows, "a non-empty array of [[rows]] tables")
        for i, r in enumerate(rows):
            w = f"{where} rows[{i}]"
            if not isinstance(r, dict):
                raise SpecError(where, f"rows[{i}]", r, "a table")
            check_keys(w, r, _ROW_KEYS)
            gpu = get_str(w, r, "gpu")
            cat.accelerator(gpu)  # unknown names list the known ones
            prec = get_str(w, r, "precision", allowed=tuple(cat.precisions))
            m = Measurement(
                source=sid, source_title=get_str(f"{where} [source]", src, "title"),
                url=get_str(f"{where} [source]", src, "url"), section=get_str(w, r, "section"),
                date=get_str(w, r, "date", default=get_str(f"{where} [source]", src, "date")),
                model=get_str(w, r, "model"), hf_id=get_str(w, r, "hf_id", default=""), gpu=gpu,
                gpus=get_int(w, r, "gpus", lo=1, hi=64), tp=get_int(w, r, "tp", lo=1, hi=64),
                dp_attention=get_int(w, r, "dp_attention", default=1, lo=1, hi=64),
                ep=get_int(w, r, "ep", default=1, lo=1, hi=64), pp=get_int(w, r, "pp", default=1, lo=1, hi=64),
                precision=prec, precision_source=get_str(w, r, "precision_source", default=""),
                kv_dtype=get_str(w, r, "kv_dtype", allowed=KV_CHOICES), engine=get_str(w, r, "engine", allowed=ENGINES),
                engine_version=get_str(w, r, "engine_version", default=""), isl=get_int(w, r, "isl", lo=1),
                osl=get_int(w, r, "osl", lo=1), concurrency=get_int(w, r, "concurrency", lo=0),
                random_range_ratio=get_float(w, r, "random_range_ratio", default=1.0, lo=0.0, hi=1.0),
                metric=get_str(w, r, "metric", allowed=METRICS), value=get_float(w, r, "value", lo=0.0, lo_open=True),
                note=get_str(w, r, "note", default=""), index=i)
            if m.tp * m.dp_attention * m.pp != m.gpus:
                raise SpecError(w, "gpus", m.gpus, f"tp x dp_attention x pp = {m.tp * m.dp_attention * m.pp}")
            if m.gpus % m.ep or m.ep > m.tp * m.dp_attention:
                raise SpecError(w, "ep", m.ep, f"a divisor of tp x dp_attention ({m.tp * m.dp_attention})")
            out.append(m)
    return out


# ---- predictions ------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Prediction:
    row: str                       # Measurement.key
    backend: str                   # the backend asked for
    priced_by: str | None          # who priced it (None: not comparable)
    value: float | None            # in the row's metric
    batch: float | None            # concurrency used
    reason: str = ""               # why not comparable

    @property
    def ok(self) -> bool:
        return self.value is not None and math.isfinite(self.value) and self.value > 0


def _spec(m: Measurement) -> ModelSpec | None:
    return load_model_spec(m.model) if m.model in known_models() else None


def row_replica(m: Measurement, backend: str, *, catalog: Catalog | None = None,
                efficiency: Efficiency | None = None) -> ReplicaModel:
    """The replica that ran row `m` (its GPU, layout, precision, KV, engine), priced by `backend`."""
    spec = _spec(m)
    if spec is None:
        raise SpecError(f"measurement {m.key}", "model", m.model,
                        "a spec in data/models (the spec format cannot describe this model)")
    if m.pp > 1:
        raise SpecError(f"measurement {m.key}", "pp", m.pp, "1 (pipeline parallelism is not modelled)")
    cat = catalog or load_catalog()
    return replica_model(spec, m.gpu, m.precision, m.kv, catalog=cat, emulated=True, efficiency=efficiency,
                         layout=m.layout, kv_budget_tokens=m.isl + m.osl, backend=backend, engine=m.engine,
                         max_batch=max(m.concurrency, OFFLINE_MAX_BATCH))


def predict_with(m: Measurement, rm: ReplicaModel) -> tuple[float | None, float | None, str]:
    """(value in m's metric, batch, reason) for replica `rm` running row m's setup."""
    isl, osl = m.mean_isl, m.mean_osl
    ctx = isl + osl / 2.0
    if m.concurrency > 0:
        c = float(m.concurrency)
        if rm.kv_capacity_tokens < c * (m.isl + m.osl):
            return None, c, f"the KV cache does not hold {m.concurrency} x {m.isl + m.osl} tokens"
    else:
        c = float(min(rm.kv_capacity_tokens // (m.isl + m.osl), OFFLINE_MAX_BATCH * rm.dp_attention))
        if c < 1:
            return None, c, "no sequence fits the KV cache"
    step = float(rm.decode_step_s(c, ctx))
    if m.metric == "tpot_ms":
        return step * 1e3, c, ""
    cycle = (c / rm.dp_attention) * float(rm.prefill_s(isl, 0)) + osl * step
    return c * osl / cycle / rm.n_gpus, c, ""


def predict(m: Measurement, backend: str, *, catalog: Catalog | None = None,
            efficiency: Efficiency | None = None) -> Prediction:
    """The cost model's figure for row m with `backend` ('roofline' or 'aiconfigurator'), or why none."""
    try:
        rm = row_replica(m, backend, catalog=catalog, efficiency=efficiency)
    except NotCovered as e:
        return Prediction(row=m.key, backend=backend, priced_by=None, value=None, batch=None,
                          reason=f"not covered: {e.field} {e.value}")
    except FitError:
        return Prediction(row=m.key, backend=backend, priced_by=None, value=None, batch=None,
                          reason="does not fit the GPUs' memory in the cost model")
    except SpecError as e:
        return Prediction(row=m.key, backend=backend, priced_by=None, value=None, batch=None,
                          reason=f"{e.field}: {e.allowed}")
    v, c, why = predict_with(m, rm)
    return Prediction(row=m.key, backend=backend, priced_by=rm.backend if v is not None else None, value=v, batch=c,
                      reason=why)


# ---- comparison -------------------------------------------------------------------------------------------

def factor(pred: float, meas: float) -> float:
    """How far off, as a factor >= 1: max(pred/meas, meas/pred)."""
    r = pred / meas
    return max(r, 1.0 / r)


def ratio_for(m: Measurement, pred: float) -> float:
    """predicted / published as 'speed': for TPOT (lower is faster) the inverse, so > 1 always means the model
    is optimistic."""
    return m.value / pred if m.metric == "tpot_ms" else pred / m.value


def summarize(ratios: Sequence[float]) -> dict[str, Any]:
    """n, median factor, worst factor, median ratio (> 1: the model is optimistic)."""
    r = np.asarray([x for x in ratios if x is not None and math.isfinite(x) and x > 0], dtype=np.float64)
    if r.size == 0:
        return {"n": 0, "median_factor": None, "worst_factor": None, "median_ratio": None}
    f = np.maximum(r, 1.0 / r)
    return {"n": int(r.size), "median_factor": float(np.median(f)), "worst_factor": float(f.max()),
            "median_ratio": float(np.exp(np.median(np.log(r))))}


def compare(rows: Iterable[Measurement], backends: Sequence[str] = ("roofline", "aiconfigurator"), *,
            catalog: Catalog | None = None, efficiency_for: Any = None) -> dict[str, Any]:
    """Every row predicted by every backend; summaries per backend and per (backend, accelerator / precision /
    source / regime). `efficiency_for(row) -> Efficiency | None` lets a fitted roofline be compared."""
    cat = catalog or load_catalog()
    rows = list(rows)
    table = []
    for m in rows:
        entry: dict[str, Any] = {"row": m.key, **{k: v for k, v in asdict(m).items() if k not in ("url",)},
                                 "layout": m.layout.label + (f"-PP{m.pp}" if m.pp > 1 else ""), "regime": m.regime}
        for b in backends:
            eff = efficiency_for(m) if (efficiency_for is not None and b == "roofline") else None
            p = predict(m, b, catalog=cat, efficiency=eff)
            entry[b] = {"value": p.value, "priced_by": p.priced_by, "batch": p.batch, "reason": p.reason,
                        "ratio": ratio_for(m, p.value) if p.ok else None}
        table.append(entry)
    summary: dict[str, Any] = {}
    for b in backends:
        ok = [e for e in table if e[b]["ratio"] is not None and e[b]["priced_by"] == b]
        by: dict[str, Any] = {"all": summarize([e[b]["ratio"] for e in ok])}
        for dim in ("gpu", "precision", "source", "regime", "model"):
            vals = sorted({str(e[dim]) for e in ok})
            by[dim] = {v: summarize([e[b]["ratio"] for e in ok if str(e[dim]) == v]) for v in vals}
        by["not_priced"] = len(table) - len(ok)
        summary[b] = by
    return {"rows": table, "summary": summary, "n_rows": len(table), "sources": sorted({m.source for m in rows})}
