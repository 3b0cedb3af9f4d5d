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
precision and source.

`predict_user(row, backend)` prices a max-throughput row the way a user, the planner and the catalog get a
replica: not at the row's own layout and batch but with `replica_model(layout="cheapest")` (backend "auto"
for the measured one: measured where covered, the roofline elsewhere; the default engines) at the row's
lengths (`row_load`: ISL + OSL / 2 context, ISL + OSL KV per request, ISL prefilled per OSL reply, the offline
cap of `OFFLINE_MAX_BATCH` per attention-DP rank), read at that layout's operating point (the batch the KV
holds, prefill charged per DP rank): output tokens/s per GPU. `compare` reports it beside the fixed-layout
comparison (`user_path`). Pure numpy; aiconfigurator is reached only through costmodel/steptime/measured.py.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.paths import data_path
from mixfleet.costmodel.specs.catalog import Catalog, load_catalog
from mixfleet.costmodel.specs.model import ModelSpec, known_models, load_model_spec
from mixfleet.costmodel.steptime.measured import Layout, NotCovered
from mixfleet.costmodel.steptime.roofline import Efficiency, FitError, ReplicaModel, ServingLoad, replica_model
from mixfleet.costmodel.tomlread import check_keys, get_float, get_int, get_str, get_table, read_toml

METRICS = ("output_tokens_per_s_per_gpu", "tpot_ms", "decode_step_ms")
SERVING_ENGINES = ("sglang", "trtllm", "vllm")
REFERENCE_ENGINE = "torch-reference"  # this project's reference kernels (benchmarks/decode_step_profile.py)
ENGINES = (*SERVING_ENGINES, REFERENCE_ENGINE)
KV_CHOICES = ("auto", "bf16", "fp8_e4m3")
OFFLINE_MAX_BATCH = 2048            # per attention-DP group: the engines' largest CUDA-graph batch in these runs
MAX_CONCURRENCY = 65_536           # far above any published serving benchmark's; bounds what a row can ask to price
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
    def serving(self) -> bool:
        """A serving engine's figure (published); False for this project's reference-kernel profile, which the
        efficiency fit and the published summaries leave out (it is reported apart: `compare`'s "reference")."""
        return self.engine in SERVING_ENGINES

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
            gpu = get_str(w, r, "gpu", allowed=tuple(cat.accelerators))     # the file and row named
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
                osl=get_int(w, r, "osl", lo=1), concurrency=get_int(w, r, "concurrency", lo=0, hi=MAX_CONCURRENCY),
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
    if m.metric == "decode_step_ms":      # one step with `concurrency` sequences of `isl` cached tokens each
        c = float(m.concurrency)
        if rm.kv_capacity_tokens < c * m.isl:
            return None, c, f"the KV cache does not hold {m.concurrency} x {m.isl} tokens"
        return float(rm.decode_step_s(c, float(m.isl))) * 1e3, c, ""
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


# ---- the path users get ----------------------------------------------------------------------------------

USER_BACKENDS = {"roofline": "roofline", "aiconfigurator": "auto"}   # compare's backend -> replica_model's


def row_load(m: Measurement) -> ServingLoad:
    """What row m's benchmark asks of a replica: its mean lengths, a KV of ISL + OSL per request, ISL prefilled
    per OSL generated, and the engines' offline running cap (`OFFLINE_MAX_BATCH` per attention-DP rank)."""
    return ServingLoad(context=m.mean_isl + m.mean_osl / 2.0, kv_per_request=float(m.isl + m.osl),
                       prefill_tokens=m.mean_isl, reply_tokens=m.mean_osl, max_running=OFFLINE_MAX_BATCH)


def user_path_row(m: Measurement) -> bool:
    """A row the user path is held against: offline maximum throughput, output tokens/s per GPU."""
    return m.concurrency == 0 and m.metric == "output_tokens_per_s_per_gpu"


@dataclass(frozen=True, kw_only=True)
class UserPrediction:
    row: str
    backend: str                   # compare's backend name (roofline | aiconfigurator)
    layout: str | None             # the layout replica_model(layout="cheapest") chose
    priced_by: str | None          # who priced the chosen replica (None: not comparable)
    value: float | None            # output tokens/s per GPU at its operating point
    batch: float | None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.value is not None and math.isfinite(self.value) and self.value > 0


def predict_user(m: Measurement, backend: str, *, catalog: Catalog | None = None) -> UserPrediction:
    """Row m as a user gets it: `replica_model(layout="cheapest", load=row_load(m))` on the row's GPU type,
    precision and KV (backend "auto" for "aiconfigurator", the default engines), any GPU count up to the
    accelerator's, read at its operating point (`ReplicaModel.operating_point`): output tokens/s per GPU."""
    def none(reason: str) -> UserPrediction:
        return UserPrediction(row=m.key, backend=backend, layout=None, priced_by=None, value=None, batch=None,
                              reason=reason)

    if backend not in USER_BACKENDS:
        raise SpecError("user path", "backend", backend, tuple(USER_BACKENDS))
    if not user_path_row(m):
        return none("not a max-throughput row")
    spec = _spec(m)
    if spec is None:
        return none("model: a spec in data/models (the spec format cannot describe this model)")
    load = row_load(m)
    try:
        rm = replica_model(spec, m.gpu, m.precision, m.kv, catalog=catalog or load_catalog(), emulated=True,
                           layout="cheapest", load=load, kv_budget_tokens=m.isl + m.osl,
                           backend=USER_BACKENDS[backend], max_batch=OFFLINE_MAX_BATCH)
    except FitError:
        return none("does not fit the GPUs' memory in the cost model")
    except SpecError as e:
        return none(f"{e.field}: {e.allowed}")
    op = rm.operating_point(load)
    return UserPrediction(row=m.key, backend=backend, layout=rm.layout.label, priced_by=rm.backend,
                          value=op.tokens_per_s_per_gpu, batch=op.batch)


# ---- comparison -------------------------------------------------------------------------------------------

def factor(pred: float, meas: float) -> float:
    """How far off, as a factor >= 1: max(pred/meas, meas/pred)."""
    r = pred / meas
    return max(r, 1.0 / r)


def ratio_for(m: Measurement, pred: float) -> float:
    """predicted / published as 'speed': for TPOT (lower is faster) the inverse, so > 1 always means the model
    is optimistic."""
    return m.value / pred if m.metric in ("tpot_ms", "decode_step_ms") else pred / m.value


def summarize(ratios: Sequence[float]) -> dict[str, Any]:
    """n, median factor, worst factor, median ratio (> 1: the model is optimistic)."""
    r = np.asarray([x for x in ratios if x is not None and math.isfinite(x) and x > 0], dtype=np.float64)
    if r.size == 0:
        return {"n": 0, "median_factor": None, "worst_factor": None, "median_ratio": None}
    f = np.maximum(r, 1.0 / r)
    return {"n": int(r.size), "median_factor": float(np.median(f)), "worst_factor": float(f.max()),
            "median_ratio": float(np.exp(np.median(np.log(r))))}


def compare(rows: Iterable[Measurement], backends: Sequence[str] = ("roofline", "aiconfigurator"), *,
            catalog: Catalog | None = None, efficiency_for: Any = None, user: bool = True) -> dict[str, Any]:
    """Every row predicted by every backend; summaries per backend and per (backend, accelerator / precision /
    source / regime). `efficiency_for(row) -> Efficiency | None` lets a fitted roofline be compared. With
    `user` (default) also `user_path`: the max-throughput rows as users get them (`user_path`), beside the
    fixed-layout figures of the same rows."""
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
    # this project's reference-kernel profile is summarized apart: not a serving engine's figure
    serving = [e for m, e in zip(rows, table, strict=True) if m.serving]
    ref = [e for m, e in zip(rows, table, strict=True) if not m.serving]
    for b in backends:
        ok = [e for e in serving if e[b]["ratio"] is not None and e[b]["priced_by"] == b]
        by: dict[str, Any] = {"all": summarize([e[b]["ratio"] for e in ok])}
        for dim in ("gpu", "precision", "source", "regime", "model"):
            vals = sorted({str(e[dim]) for e in ok})
            by[dim] = {v: summarize([e[b]["ratio"] for e in ok if str(e[dim]) == v]) for v in vals}
        by["not_priced"] = len(serving) - len(ok)
        ref_ok = [e for e in ref if e[b]["ratio"] is not None and e[b]["priced_by"] == b]
        by["reference"] = {**summarize([e[b]["ratio"] for e in ref_ok]), "not_priced": len(ref) - len(ref_ok)}
        summary[b] = by
    return {"rows": table, "summary": summary, "n_rows": len(table), "sources": sorted({m.source for m in rows}),
            "user_path": user_path(rows, backends, catalog=cat, fixed=table) if user else None}


def user_path(rows: Iterable[Measurement], backends: Sequence[str] = ("roofline", "aiconfigurator"), *,
              catalog: Catalog | None = None, fixed: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The max-throughput rows as users get them (`predict_user`), beside the fixed-layout prediction of the
    same rows (`fixed`: compare's table; recomputed when None): per row the layout chosen, its value and ratio;
    per backend the summary of both over the same rows, and (`user_vs_best_published`) per setup (source, GPU,
    model, precision, lengths) the user figure against the best layout the publisher ran for it, its
    max-throughput figure (a layout sweep's other rows are slower layouts, not what the user path picks). For
    the measured backend a row counts where the replica the user gets was priced by it (a layout it does not
    cover falls back to the roofline: counted apart, `fell_back`)."""
    cat = catalog or load_catalog()
    rows = [m for m in rows if user_path_row(m)]
    by_key = {e["row"]: e for e in (fixed or [])}
    table = []
    for m in rows:
        entry: dict[str, Any] = {"row": m.key, "gpu": m.gpu, "model": m.model, "precision": m.precision,
                                 "isl": m.isl, "osl": m.osl, "published_layout": m.layout.label, "value": m.value}
        for b in backends:
            u = predict_user(m, b, catalog=cat)
            f = by_key[m.key][b] if m.key in by_key else None
            if f is None:
                p = predict(m, b, catalog=cat)
                f = {"value": p.value, "priced_by": p.priced_by, "ratio": ratio_for(m, p.value) if p.ok else None}
            entry[b] = {"layout": u.layout, "value": u.value, "priced_by": u.priced_by, "batch": u.batch,
                        "reason": u.reason, "ratio": ratio_for(m, u.value) if u.ok else None,
                        "fixed_value": f["value"], "fixed_priced_by": f["priced_by"], "fixed_ratio": f["ratio"]}
        table.append(entry)
    # a setup (source, GPU, model, precision, lengths) the publisher ran in several layouts has one user figure;
    # its max-throughput figure is the best of them
    best: dict[tuple, float] = {}
    for m in rows:
        k = _setup(m)
        best[k] = max(best.get(k, 0.0), m.value)
    for m, e in zip(rows, table, strict=True):
        e["setup_best_published"] = best[_setup(m)]
        for b in backends:
            v = e[b]["value"]
            e[b]["ratio_to_best"] = v / best[_setup(m)] if e[b]["ratio"] is not None else None
    summary: dict[str, Any] = {}
    for b in backends:
        ok = [e for e in table if e[b]["ratio"] is not None and e[b]["priced_by"] == b]
        both = [e for e in ok if e[b]["fixed_ratio"] is not None and e[b]["fixed_priced_by"] == b]
        setups = {_setup(m): e[b]["ratio_to_best"] for m, e in zip(rows, table, strict=True) if e in ok}
        summary[b] = {"user": summarize([e[b]["ratio"] for e in ok]),
                      "user_vs_best_published": summarize(list(setups.values())),
                      "user_same_rows_as_fixed": summarize([e[b]["ratio"] for e in both]),
                      "fixed_same_rows": summarize([e[b]["fixed_ratio"] for e in both]),
                      "fell_back": sum(1 for e in table if e[b]["ratio"] is not None and e[b]["priced_by"] != b),
                      "not_priced": sum(1 for e in table if e[b]["ratio"] is None),
                      "worst_row": _worst_row(ok, b)}
    return {"rows": table, "summary": summary, "n_rows": len(table), "n_setups": len(best)}


def _worst_row(entries: list[dict[str, Any]], b: str) -> dict[str, Any] | None:
    """The row farthest off for backend b, with what bounds it: `setup_spread` = the best published figure of its
    setup / its own. A row of a layout sweep that is `setup_spread` x slower than its setup's best layout cannot be
    within a factor f of one user figure unless that figure is at least `setup_spread / f` x below the best."""
    if not entries:
        return None
    e = max(entries, key=lambda x: factor(x[b]["ratio"], 1.0))
    return {"row": e["row"], "published_layout": e["published_layout"], "published": e["value"],
            "layout": e[b]["layout"], "value": e[b]["value"], "factor": factor(e[b]["ratio"], 1.0),
            "setup_best_published": e["setup_best_published"],
            "setup_spread": e["setup_best_published"] / e["value"]}


def _setup(m: Measurement) -> tuple[str, str, str, str, int, int]:
    return (m.source, m.gpu, m.model, m.precision, m.isl, m.osl)
