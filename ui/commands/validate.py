"""`mixfleet validate-costmodel`: the cost model against published GPU serving measurements.

Rendering only: the rows are `mixfleet.costmodel.steptime.measurements` (data/measurements/*.toml), the predictions
its `compare`. Bad input prints one line (field, value, what is allowed) and exits with code 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(code=2)


def _f(x: Any, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def register(app: typer.Typer) -> None:
    """Add `validate-costmodel` to the `mixfleet` app."""

    @app.command("validate-costmodel")
    def validate_cmd(
        measurements: Path = typer.Option(None, "--measurements", help="Folder or file of measurements (default: "
                                          "the shipped data/measurements)."),
        backends: str = typer.Option("roofline,aiconfigurator", "--backends", help="Comma-separated backends."),
        calibration: Path = typer.Option(None, "--calibration", "-c", help="Fitted roofline factors (from "
                                         "`mixfleet calibrate --measurements`) to compare as 'roofline'."),
        rows: bool = typer.Option(False, "--rows", help="Also print every row."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    ) -> None:
        """Each published figure vs the cost model's prediction for that exact setup (layout, lengths,
        concurrency): model / published, median and worst factor per backend, accelerator, precision, source;
        and the path users get: each max-throughput row at the layout and operating point the planner chooses."""
        from mixfleet.costmodel.errors import SpecError
        from mixfleet.costmodel.steptime.measurements import compare, load_measurements

        names = [b.strip() for b in backends.split(",") if b.strip()]
        try:
            for b in names:
                if b not in ("roofline", "aiconfigurator"):
                    raise SpecError("command line", "--backends", b, ("roofline", "aiconfigurator"))
            ms = load_measurements(measurements)
            eff_for = None
            if calibration is not None:
                from mixfleet.costmodel.steptime.measurement_fit import load_fit

                eff_for = load_fit(calibration).efficiency_for
            rep = compare(ms, names, efficiency_for=eff_for)
        except (SpecError, FileNotFoundError, OSError) as e:
            _fail(e)
        if as_json:
            typer.echo(json.dumps(rep, indent=2, default=str))
            return
        _print(rep, names, rows)


def _print(rep: dict[str, Any], names: list[str], show_rows: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title=f"Cost model vs {rep['n_rows']} figures from {len(rep['sources'])} sources (factor = "
                    "max(model/published, published/model); ratio > 1: the model is optimistic; 'reference kernels': "
                    "this project's own GPU profile, kept out of 'all')")
    for col in ("backend", "group", "value", "rows", "median factor", "worst factor", "median ratio"):
        t.add_column(col, justify="left" if col in ("backend", "group", "value") else "right")
    for b in names:
        s = rep["summary"][b]
        a = s["all"]
        t.add_row(b, "all", "", str(a["n"]), _f(a["median_factor"]), _f(a["worst_factor"]), _f(a["median_ratio"]),
                  style="bold")
        for dim in ("gpu", "precision", "regime", "source", "model"):
            for k, v in s[dim].items():
                t.add_row("", dim, k, str(v["n"]), _f(v["median_factor"]), _f(v["worst_factor"]), _f(v["median_ratio"]))
        t.add_row("", "not priced", "", str(s["not_priced"]), "", "", "")
        r = s.get("reference")
        if r and (r["n"] or r["not_priced"]):   # this project's reference-kernel profile: apart from "all"
            t.add_row("", "reference kernels", f"(not priced: {r['not_priced']})", str(r["n"]), _f(r["median_factor"]),
                      _f(r["worst_factor"]), _f(r["median_ratio"]), style="dim")
    con.print(t)
    up = rep.get("user_path")
    if up and up["n_rows"]:
        u = Table(title=f"The path users get: {up['n_rows']} max-throughput rows ({up['n_setups']} setups), each as "
                        "replica_model(layout='cheapest', backend='auto') prices it at the row's lengths, at that "
                        "layout's operating point (prefill per DP rank), beside the row's own layout")
        for col in ("backend", "prediction", "rows", "median factor", "worst factor", "median ratio"):
            u.add_column(col, justify="left" if col in ("backend", "prediction") else "right")
        for b in names:
            s = up["summary"][b]
            for j, (label, key) in enumerate((("fixed layout, the same rows", "fixed_same_rows"),
                                              ("user path, the same rows", "user_same_rows_as_fixed"),
                                              ("user path, every max-throughput row", "user"),
                                              ("user path vs the best published layout", "user_vs_best_published"))):
                v = s[key]
                u.add_row(b if j == 0 else "", label, str(v["n"]), _f(v["median_factor"]), _f(v["worst_factor"]),
                          _f(v["median_ratio"]), style="bold" if key == "user_vs_best_published" else None)
            u.add_row("", f"fell back to the roofline: {s['fell_back']}, not priced: {s['not_priced']}", "", "", "",
                      "")
            w = s.get("worst_row")
            if w is not None:
                u.add_row("", f"worst row {w['row']}: published {w['published_layout']} {w['published']:,.0f}, user "
                              f"{w['layout']} {w['value']:,.0f}; its setup's best published layout "
                              f"{w['setup_best_published']:,.0f} ({w['setup_spread']:.2f}x this row)",
                          "", "", _f(w["factor"]), "")
        con.print(u)
    if show_rows:
        r = Table(title="Rows (published vs each backend)")
        for col in ("row", "gpu", "model", "layout", "prec", "ISL/OSL", "conc", "metric", "published", *names):
            r.add_column(col)
        for e in rep["rows"]:
            cells = []
            for b in names:
                x = e[b]
                cells.append(f"{x['value']:,.1f} ({x['ratio']:.2f})" if x["ratio"] is not None else x["reason"][:40])
            r.add_row(e["row"], e["gpu"], e["model"], e["layout"], e["precision"], f"{e['isl']}/{e['osl']}",
                      str(e["concurrency"]), e["metric"], f"{e['value']:,.1f}", *cells)
        con.print(r)
