"""Plain-data reports over the catalog for people: the catalog table and one replica's capacity curves.

`catalog_report` evaluates every (accelerator, precision) pair for a model: native / emulated /
unsupported, the TP it needs, tokens/s and $/Mtoken at a few batch sizes, and ranks accelerators by
their best $/Mtoken. `capacity_report` gives one replica's throughput over batch x context. Both
return JSON-ready dicts; the CLI only renders them.
"""

from __future__ import annotations

import math
from typing import Any

from mixfleet.costmodel.errors import SpecError
from mixfleet.costmodel.limits import MAX_BATCH, check_count
from mixfleet.costmodel.specs.catalog import Catalog, load_catalog
from mixfleet.costmodel.specs.formats import formats
from mixfleet.costmodel.specs.model import ModelSpec, load_model_spec
from mixfleet.costmodel.steptime.measured import Layout
from mixfleet.costmodel.steptime.roofline import (
    DEFAULT_MAX_BATCH,
    Efficiency,
    FitError,
    candidate_layouts,
    kv_capacity_tokens,
    replica_model,
    weight_sync_s,
)

DEFAULT_MODEL = "qwen3.6-35b-a3b"
DEFAULT_BATCHES = (1, 8, 32, 128)
DEFAULT_PRECISIONS = formats().gpu_precisions   # native on some GPU (data/precisions.toml)
CAPACITY_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CAPACITY_CONTEXTS = (1024, 8192, 32768, 131072, 262144)


def _num(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def catalog_report(model: ModelSpec | str = DEFAULT_MODEL, *, catalog: Catalog | None = None,
                   accelerators: list[str] | None = None, precisions: list[str] | None = None,
                   kv_dtype: str = "fp8_e4m3", batches: tuple[int, ...] = DEFAULT_BATCHES,
                   mean_context: int = 8192, kv_budget_tokens: int | None = None,
                   include_emulated_in_ranking: bool = False, efficiency: Efficiency | None = None,
                   backend: str = "roofline", layout: str | None = None) -> dict[str, Any]:
    """Every (accelerator, precision) pair for `model`: support, TP, tokens/s and $/Mtoken, and which backend
    priced it (roofline or the measured aiconfigurator tables); ranked accelerators."""
    cat = catalog or load_catalog()
    m = load_model_spec(model) if isinstance(model, str) else model
    accs = [cat.accelerator(a).name for a in (accelerators or cat.gpus())]
    precs = [cat.precision(p).name for p in (precisions or DEFAULT_PRECISIONS)]
    kv = cat.kv_dtype(kv_dtype).name
    _check_points(m, batches, (), mean_context)
    rows: list[dict[str, Any]] = []
    for a in accs:
        for p in precs:
            support = cat.support(a, p)
            row: dict[str, Any] = {"accelerator": a, "precision": p, "kv_dtype": kv, "support": support,
                                   "tp": None, "fits_one_gpu": False, "tokens_per_s": {}, "usd_per_mtoken": {},
                                   "best": None, "price_usd_per_hour": None, "price_estimate": None, "error": None,
                                   "backend": None, "backend_source": None, "layout": None}
            rows.append(row)
            if support == "unsupported":
                continue
            try:
                r = replica_model(m, a, p, kv, catalog=cat, emulated=True, efficiency=efficiency,
                                  kv_budget_tokens=kv_budget_tokens, backend=backend, layout=layout,
                                  mean_context=mean_context)
            except FitError as e:
                row["error"] = str(e)
                continue
            row.update(tp=r.n_gpus, layout=r.layout.label, backend=r.backend, backend_source=r.backend_source,
                       fits_one_gpu=r.n_gpus == 1, price_usd_per_hour=r.price_usd_per_hour,
                       price_estimate=r.accelerator.price_estimate, kv_capacity_tokens=r.kv_capacity_tokens,
                       weight_gb=r.weight_bytes / 1e9)
            bmax = r.max_batch(mean_context, cap=max(max(batches), DEFAULT_MAX_BATCH))
            for b in batches:
                ok = b <= bmax
                row["tokens_per_s"][str(b)] = _num(r.tokens_per_s(b, mean_context)) if ok else None
                row["usd_per_mtoken"][str(b)] = _num(r.usd_per_mtoken(b, mean_context)) if ok else None
            best = r.best_operating_point(mean_context)
            row["best"] = {k: _num(v) if k != "batch" else int(v) for k, v in best.items()}
    ranking = []
    for a in accs:
        cands = [r for r in rows if r["accelerator"] == a and r["best"] and r["best"]["usd_per_mtoken"] is not None
                 and (r["support"] == "native" or include_emulated_in_ranking)]
        if not cands:
            ranking.append({"accelerator": a, "precision": None, "usd_per_mtoken": None, "tp": None})
            continue
        b = min(cands, key=lambda r: r["best"]["usd_per_mtoken"])
        ranking.append({"accelerator": a, "precision": b["precision"], "usd_per_mtoken": b["best"]["usd_per_mtoken"],
                        "tokens_per_s": b["best"]["tokens_per_s"], "batch": b["best"]["batch"], "tp": b["tp"]})
    ranking.sort(key=lambda x: (x["usd_per_mtoken"] is None, x["usd_per_mtoken"] or 0.0))
    needs_tp = [{"accelerator": r["accelerator"], "precision": r["precision"], "tp": r["tp"]}
                for r in rows if r["tp"] is not None and r["tp"] > 1]
    no_fit = [{"accelerator": r["accelerator"], "precision": r["precision"], "error": r["error"]}
              for r in rows if r["error"]]
    return {"model": m.name, "model_estimate": m.estimate, "price_table": cat.price_table,
            "price_table_source": cat.price_table_source, "kv_dtype": kv, "mean_context": mean_context,
            "kv_budget_tokens": kv_budget_tokens if kv_budget_tokens is not None else m.max_context,
            "batches": list(batches), "rows": rows, "ranking": ranking, "needs_tp": needs_tp, "no_fit": no_fit,
            "backend_requested": backend,
            "priced_by": {b: [f"{r['accelerator']}-{r['precision']}" for r in rows if r["backend"] == b]
                          for b in ("aiconfigurator", "roofline")}}


def _check_points(m: ModelSpec, batches: tuple[int, ...], contexts: tuple[int, ...], mean_context: int | None) -> None:
    """Batches within 1..MAX_BATCH, contexts within the model's own max context (beyond it no sequence exists)."""
    if not batches:
        raise SpecError("capacity", "batches", list(batches), f"at least one batch size in 1..{MAX_BATCH}")
    for b in batches:
        check_count("capacity", "batches", b, 1, MAX_BATCH)
    note = f" ({m.name}'s max context)"
    for c in contexts:
        check_count("capacity", "contexts", c, 1, m.max_context, note)
    if mean_context is not None:
        check_count("capacity", "mean_context", mean_context, 1, m.max_context, note)


def capacity_report(model: ModelSpec | str, accelerator: str, precision: str, kv_dtype: str = "fp8_e4m3", *,
                    catalog: Catalog | None = None, tp: int | None = None, emulated: bool = False,
                    batches: tuple[int, ...] = CAPACITY_BATCHES, contexts: tuple[int, ...] | None = None,
                    kv_budget_tokens: int | None = None, efficiency: Efficiency | None = None,
                    backend: str = "roofline", layout: str | None = None, mean_context: int | None = None,
                    max_batch: int = DEFAULT_MAX_BATCH) -> dict[str, Any]:
    """One replica: tokens/s, step time and $/Mtoken over batch x context; KV capacity; prefill; sync; and every
    candidate layout side by side (TP 1-8, for MoE attention DP + EP) at `mean_context`.

    `layout`: None (smallest TP that fits), "cheapest", or a label ("TP4", "DEP8", "TP2-DP2-EP4")."""
    cat = catalog or load_catalog()
    m = load_model_spec(model) if isinstance(model, str) else model
    lay: Layout | str | None = layout
    if isinstance(layout, str) and layout not in ("smallest", "cheapest"):
        lay = Layout.parse(layout)
    _check_points(m, batches, contexts or (), mean_context)
    budget = kv_budget_tokens if kv_budget_tokens is not None else m.max_context
    ctx_sel = mean_context if mean_context is not None else max(1, budget // 4)
    r = replica_model(m, accelerator, precision, kv_dtype, catalog=cat, tp=tp, emulated=emulated,
                      efficiency=efficiency, kv_budget_tokens=kv_budget_tokens, backend=backend, layout=lay,
                      mean_context=ctx_sel, max_batch=max_batch)
    ctxs = contexts or tuple(c for c in CAPACITY_CONTEXTS if c <= m.max_context) or (m.max_context,)
    grid = []
    for c in ctxs:
        bmax = int(r.max_batch(c, cap=max(batches)))
        for b in batches:
            ok = b <= bmax
            grid.append({"context": c, "batch": b, "fits_kv": ok,
                         "step_ms": _num(r.decode_step_s(b, c) * 1e3),
                         "tokens_per_s": _num(r.tokens_per_s(b, c)),
                         "usd_per_mtoken": _num(r.usd_per_mtoken(b, c))})
    prefill = [{"new_tokens": n, "context_before": 0, "seconds": _num(r.prefill_s(n, 0))}
               for n in (128, 1024, 8192) if n <= m.max_context]
    return {"model": m.name, "price_table": cat.price_table, **r.summary(),
            "layouts": layouts_report(m, accelerator, precision, kv_dtype, catalog=cat, emulated=emulated,
                                      efficiency=efficiency, kv_budget_tokens=budget, backend=backend,
                                      mean_context=ctx_sel, max_batch=max_batch, chosen=r.layout.label),
            "layout_context": ctx_sel,
            "max_batch": {str(c): int(r.max_batch(c, cap=max(batches))) for c in ctxs},
            "best": {str(c): r.best_operating_point(c) for c in ctxs}, "grid": grid, "prefill": prefill,
            "weight_sync_s": weight_sync_s(r)}


def layouts_report(model: ModelSpec, accelerator: str, precision: str, kv_dtype: str, *, catalog: Catalog,
                   emulated: bool, efficiency: Efficiency | None, kv_budget_tokens: int, backend: str,
                   mean_context: int, max_batch: int = DEFAULT_MAX_BATCH, chosen: str = "") -> list[dict[str, Any]]:
    """Every candidate layout on 1-8 GPUs side by side: fits, KV capacity, best batch, tokens/s per GPU and
    $/Mtoken at `mean_context` (batch limit `max_batch` per attention-DP group), the backend that priced it."""
    cat = catalog
    acc, prec, kv = cat.accelerator(accelerator), cat.precision(precision), cat.kv_dtype(kv_dtype)
    out = []
    for lay in candidate_layouts(model, acc.max_tp):
        row: dict[str, Any] = {"layout": lay.label, "tp": lay.tp, "dp_attention": lay.dp_attention, "ep": lay.ep,
                               "gpus": lay.gpus, "chosen": lay.label == chosen,
                               "kv_capacity_tokens": kv_capacity_tokens(model, acc, prec, kv, lay.tp, lay.dp_attention),
                               "fits": False, "batch": None, "tokens_per_s": None, "tokens_per_s_per_gpu": None,
                               "usd_per_mtoken": None, "backend": None, "error": None}
        out.append(row)
        try:
            r = replica_model(model, acc, prec, kv, catalog=cat, emulated=emulated, efficiency=efficiency,
                              kv_budget_tokens=kv_budget_tokens, layout=lay, backend=backend)
        except FitError:
            continue
        except SpecError as e:
            row["error"] = str(e)
            continue
        best = r.best_operating_point(mean_context, max_batch * lay.dp_attention)
        row.update(fits=True, batch=int(best["batch"]), tokens_per_s=_num(best["tokens_per_s"]),
                   tokens_per_s_per_gpu=_num(best["tokens_per_s"] / lay.gpus),
                   usd_per_mtoken=_num(best["usd_per_mtoken"]), backend=r.backend)
    return out
