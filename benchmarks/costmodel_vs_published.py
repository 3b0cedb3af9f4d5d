"""The cost model against published GPU serving figures, and the roofline against aiconfigurator-core on a grid.

1. Every row of data/measurements/ (one published figure each) predicted by the roofline and by the measured
   backend (aiconfigurator-core) for that exact setup: model / published, median and worst factor per
   backend, accelerator, precision, source and regime (`mixfleet validate-costmodel` prints the same).
   Beside it, the path users get (issue 25): every max-throughput row priced by `replica_model(layout=
   "cheapest", backend="auto")` at the row's lengths, at that layout's operating point, per row and per setup
   (against the best layout the publisher ran for it).
2. The roofline's factors fitted to those rows (`mixfleet calibrate --measurements`), judged leave one source out.
3. Roofline vs aiconfigurator decode-step time over (GPU, precision, batch, context, layout) for Qwen3-30B-A3B,
   the profiled model closest to the seed's (48 layers, hidden 2048, 128 experts top-8; the seed's own spec
   is an estimate aiconfigurator has no profile for).
4. The measured backend's own cost: import, first compile, a layout's table, one query (CPU seconds).

Writes benchmarks/results/costmodel_vs_published.json.

    python benchmarks/costmodel_vs_published.py
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results" / "costmodel_vs_published.json"
GRID_GPUS = ("H100", "H200", "B200", "B300", "A100-80GB", "RTX-PRO-6000")
GRID_PRECISIONS = ("bf16", "fp8", "nvfp4")
GRID_BATCHES = (1, 8, 64, 256)
GRID_CONTEXTS = (1024, 8192, 32768)
GRID_LAYOUTS = ("TP1", "TP2", "DEP2", "TP4", "DEP4")


def _timings() -> dict[str, float]:
    c0 = time.process_time()
    import aiconfigurator_core.sdk.engine  # noqa: F401

    c1 = time.process_time()
    from mixfleet.costmodel.steptime.measured import Layout, step_table
    from mixfleet.costmodel.steptime.roofline import replica_model

    rm = replica_model("llama-3.1-8b", "H100", "bf16", "bf16", kv_budget_tokens=8192)
    c2 = time.process_time()
    t = step_table(rm.model, rm.accelerator, rm.precision, rm.kv_dtype, layout=Layout(tp=1), max_context=8192)
    c3 = time.process_time()
    step_table(rm.model, rm.accelerator, rm.precision, rm.kv_dtype, layout=Layout(tp=2), max_context=8192)
    c4 = time.process_time()
    for _ in range(1000):
        t.decode(64.0, 3000.0)
    c5 = time.process_time()
    return {"import_cpu_s": c1 - c0, "first_compile_and_table_cpu_s": c3 - c2, "next_layout_table_cpu_s": c4 - c3,
            "table_lookup_us": (c5 - c4) / 1000 * 1e6, "table_points": int(t.decode_s.size + t.prefill_s.size)}


def _grid() -> dict:
    from mixfleet.costmodel.errors import SpecError
    from mixfleet.costmodel.specs.catalog import load_catalog
    from mixfleet.costmodel.steptime.measured import Layout
    from mixfleet.costmodel.steptime.measurements import summarize
    from mixfleet.costmodel.steptime.roofline import replica_model

    cat = load_catalog()
    cells = []
    for gpu in GRID_GPUS:
        for prec in GRID_PRECISIONS:
            if cat.support(gpu, prec) != "native":
                continue
            kv = "bf16" if gpu == "A100-80GB" else "fp8_e4m3"
            for lab in GRID_LAYOUTS:
                lay = Layout.parse(lab)
                try:
                    roof = replica_model("qwen3-30b-a3b", gpu, prec, kv, layout=lay, kv_budget_tokens=32768)
                    meas = replica_model("qwen3-30b-a3b", gpu, prec, kv, layout=lay, kv_budget_tokens=32768,
                                         backend="aiconfigurator")
                except SpecError as e:
                    cells.append({"gpu": gpu, "precision": prec, "layout": lab, "covered": False,
                                  "reason": f"{e.field}: {str(e.allowed)[:120]}"})
                    continue
                for b in GRID_BATCHES:
                    for c in GRID_CONTEXTS:
                        if b * c > roof.kv_capacity_tokens:
                            continue
                        r, m = float(roof.decode_step_s(b, c)), float(meas.decode_step_s(b, c))
                        cells.append({"gpu": gpu, "precision": prec, "layout": lab, "covered": True, "batch": b,
                                      "context": c, "roofline_step_ms": r * 1e3, "aiconfigurator_step_ms": m * 1e3,
                                      "speed_ratio": m / r})
    ok = [x for x in cells if x["covered"]]
    by = {}
    for dim in ("gpu", "precision", "layout", "batch"):
        by[dim] = {str(v): summarize([x["speed_ratio"] for x in ok if x[dim] == v])
                   for v in sorted({x[dim] for x in ok}, key=str)}
    return {"model": "qwen3-30b-a3b", "all": summarize([x["speed_ratio"] for x in ok]), "by": by,
            "not_covered": [x for x in cells if not x["covered"]], "cells": ok,
            "note": "speed_ratio = aiconfigurator step / roofline step (> 1: the roofline is optimistic)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from mixfleet.costmodel.steptime.measured import installed_version
    from mixfleet.costmodel.steptime.measurement_fit import fit_measurements
    from mixfleet.costmodel.steptime.measurements import compare, load_measurements

    w0, c0 = time.perf_counter(), time.process_time()
    timings = _timings()
    rows = load_measurements()
    rep = compare(rows)
    c_cmp = time.process_time()
    fit = fit_measurements(rows)
    c_fit = time.process_time()
    fitted = compare(rows, ("roofline",), efficiency_for=fit.efficiency_for)
    grid = _grid()
    result = {
        "aiconfigurator_core": installed_version(), "load_avg": os.getloadavg(), "cpu_s": time.process_time() - c0,
        "wall_s": time.perf_counter() - w0, "compare_cpu_s": c_cmp - c0, "fit_cpu_s": c_fit - c_cmp,
        "measured_backend_cost": timings, "n_rows": rep["n_rows"], "sources": rep["sources"],
        "summary": rep["summary"], "fitted_roofline_in_sample": fitted["summary"]["roofline"],
        "fit": fit.to_dict(), "grid": grid, "rows": rep["rows"], "user_path": rep["user_path"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))

    def line(name: str, s: dict) -> str:
        return (f"{name:42s} n={s['n']:3d} median factor {s['median_factor']:.2f} worst {s['worst_factor']:.2f} "
                f"median ratio {s['median_ratio']:.2f}") if s["n"] else f"{name:42s} n=0"

    print(f"{rep['n_rows']} published figures, {len(rep['sources'])} sources; load {os.getloadavg()[0]:.1f}")
    for b in ("roofline", "aiconfigurator"):
        s = rep["summary"][b]
        print(line(f"{b} (priors)" if b == "roofline" else b, s["all"]), f"not priced {s['not_priced']}")
        for dim in ("gpu", "precision", "regime", "source"):
            for k, v in s[dim].items():
                print(line(f"  {dim} {k}", v))
    up = rep["user_path"]
    print(f"the path users get: {up['n_rows']} max-throughput rows, {up['n_setups']} setups "
          "(replica_model(layout='cheapest', backend='auto') at each row's lengths, its operating point)")
    for b in ("roofline", "aiconfigurator"):
        s = up["summary"][b]
        print(line(f"{b} fixed layout, the same rows", s["fixed_same_rows"]))
        print(line(f"{b} user path, the same rows", s["user_same_rows_as_fixed"]))
        print(line(f"{b} user path, every max-throughput row", s["user"]),
              f"fell back {s['fell_back']}, not priced {s['not_priced']}")
        print(line(f"{b} user path vs best published layout", s["user_vs_best_published"]))
    print(line("roofline fitted, in sample", fit.in_sample))
    print(line("roofline fitted, out of sample (LOSO)", fit.out_of_sample))
    print(line("roofline priors, same rows", fit.priors_same_rows))
    print(f"fitted factors ship: {fit.ships}")
    print(line("grid: aiconfigurator step / roofline step", grid["all"]))
    for k, v in grid["by"]["batch"].items():
        print(line(f"  grid batch {k}", v))
    print("measured backend cost:", {k: round(v, 4) for k, v in timings.items()})
    print(f"cpu {result['cpu_s']:.1f} s, wall {result['wall_s']:.1f} s -> {args.out}")



if __name__ == "__main__":
    main()
