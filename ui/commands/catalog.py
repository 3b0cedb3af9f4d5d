"""`mixfleet` commands: catalog and capacity: what each (accelerator, precision) replica can do and cost.

Rendering only: the numbers come from `mixfleet.costmodel.steptime.report`. Bad names or files print one
clear line (the field, the value, what is allowed) and exit with code 2, never a traceback.
"""

from __future__ import annotations

import json
from typing import Any

import typer

_FMT_NONE = "—"
_BACKEND_HELP = ("Step-time backend: auto (aiconfigurator-core's measured tables where they cover the replica, "
                 "else the roofline), roofline, or aiconfigurator (refuse what it does not cover).")


def _fail(e: Exception) -> None:
    hint = " (pass --emulated)" if getattr(e, "field", None) == "emulated" else ""
    typer.echo(f"error: {e}{hint}", err=True)
    raise typer.Exit(code=2)


def _split(s: str | None) -> list[str] | None:
    return [x.strip() for x in s.split(",") if x.strip()] if s else None


def _ints(s: str, option: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        vals = ()
    if not vals or min(vals) < 1:
        from mixfleet.costmodel.errors import SpecError

        raise SpecError("command line", option, s, "comma-separated positive integers, e.g. 1,8,32")
    return vals


def _f(x: Any, spec: str = ",.0f") -> str:
    return _FMT_NONE if x is None else format(x, spec)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `mixfleet` app."""

    @app.command("catalog")
    def catalog_cmd(
        model: str = typer.Option("qwen3.6-35b-a3b", "--model", "-m", help="Model spec name or TOML path."),
        price_table: str = typer.Option(None, "--price-table", "-p", help="Price table (default: modal)."),
        accelerators: str = typer.Option(None, "--accelerators", help="Comma-separated accelerators (default: GPUs)."),
        precisions: str = typer.Option("bf16,fp8,nvfp4,mxfp4", "--precisions", help="Comma-separated precisions."),
        kv_dtype: str = typer.Option("fp8_e4m3", "--kv-dtype", help="KV-cache dtype."),
        context: int = typer.Option(8192, "--context", help="Mean context per sequence, tokens."),
        batches: str = typer.Option("1,8,32,128", "--batches", help="Batch sizes to show."),
        kv_budget: int = typer.Option(None, "--kv-budget", min=1,
                                      help="KV tokens per replica, >= 1 (default: max context)."),
        backend: str = typer.Option("auto", "--backend", help=_BACKEND_HELP),
        layout: str = typer.Option(None, "--layout", help="None: smallest TP that fits; 'cheapest': best layout."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    ) -> None:
        """Accelerators x precisions for a model: native/emulated, TP, tokens/s and $/Mtoken, the backend that
        priced each pair; ranked by $/Mtoken."""
        from mixfleet.costmodel.errors import SpecError
        from mixfleet.costmodel.specs.catalog import load_catalog
        from mixfleet.costmodel.steptime.report import catalog_report

        try:
            rep = catalog_report(model, catalog=load_catalog(price_table), accelerators=_split(accelerators),
                                 precisions=_split(precisions), kv_dtype=kv_dtype, mean_context=context,
                                 batches=_ints(batches, "--batches"), kv_budget_tokens=kv_budget, backend=backend,
                                 layout=layout)
        except (SpecError, FileNotFoundError) as e:
            _fail(e)
        if as_json:
            typer.echo(json.dumps(rep, indent=2))
            return
        _print_catalog(rep)

    @app.command("capacity")
    def capacity_cmd(
        accelerator: str = typer.Option(..., "--accelerator", "-a", help="Accelerator name (see `mixfleet catalog`)."),
        precision: str = typer.Option(..., "--precision", "-q", help="Weight precision: bf16, fp8, nvfp4, mxfp4..."),
        model: str = typer.Option("qwen3.6-35b-a3b", "--model", "-m", help="Model spec name or TOML path."),
        kv_dtype: str = typer.Option("fp8_e4m3", "--kv-dtype", help="KV-cache dtype."),
        price_table: str = typer.Option(None, "--price-table", "-p", help="Price table (default: modal)."),
        tp: int = typer.Option(None, "--tp", help="Tensor-parallel size (default: smallest that fits)."),
        emulated: bool = typer.Option(False, "--emulated", help="Allow a precision the accelerator lacks (slower)."),
        batches: str = typer.Option("1,2,4,8,16,32,64,128,256", "--batches", help="Batch sizes."),
        contexts: str = typer.Option(None, "--contexts", help="Contexts, tokens (default: 1K..256K up to max)."),
        kv_budget: int = typer.Option(None, "--kv-budget", min=1,
                                      help="KV tokens per replica, >= 1 (default: max context)."),
        backend: str = typer.Option("auto", "--backend", help=_BACKEND_HELP),
        layout: str = typer.Option(None, "--layout", help="TP4, DEP8, TP2-DP2-EP4 or 'cheapest' (default: smallest "
                                   "TP that fits)."),
        context: int = typer.Option(None, "--context", help="Mean context for the layout comparison (default: a "
                                    "quarter of the KV budget)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    ) -> None:
        """One replica's throughput vs batch and context, KV capacity, prefill and weight-sync time; every layout
        (TP 1-8, attention DP + expert parallel for MoE) side by side."""
        from mixfleet.costmodel.errors import SpecError
        from mixfleet.costmodel.specs.catalog import load_catalog
        from mixfleet.costmodel.steptime.report import capacity_report

        try:
            rep = capacity_report(model, accelerator, precision, kv_dtype, catalog=load_catalog(price_table), tp=tp,
                                  emulated=emulated, batches=_ints(batches, "--batches"),
                                  contexts=_ints(contexts, "--contexts") if contexts else None,
                                  kv_budget_tokens=kv_budget, backend=backend, layout=layout, mean_context=context)
        except (SpecError, FileNotFoundError) as e:
            _fail(e)
        if as_json:
            typer.echo(json.dumps(rep, indent=2))
            return
        _print_capacity(rep)


def _print_catalog(rep: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    bs = rep["batches"]
    t = Table(title=f"{rep['model']} on the catalog: price table '{rep['price_table']}', KV {rep['kv_dtype']}, "
                    f"mean context {rep['mean_context']:,} tokens, KV budget {rep['kv_budget_tokens']:,} tokens")
    for col in ("accelerator", "precision", "support", "backend", "1 GPU?", "GPUs", "$/h"):
        t.add_column(col, justify="left" if col in ("accelerator", "precision", "support", "backend") else "right")
    for b in bs:
        t.add_column(f"tok/s @{b}", justify="right")
    t.add_column("best $/Mtok (batch)", justify="right")
    for r in rep["rows"]:
        if r["support"] == "unsupported":
            t.add_row(r["accelerator"], r["precision"], "unsupported", *[""] * (5 + len(bs)))
            continue
        if r["error"]:
            t.add_row(r["accelerator"], r["precision"], r["support"], "", "no", "none fits", "", *[""] * len(bs), "")
            continue
        price = _f(r["price_usd_per_hour"], ".2f") + ("*" if r["price_estimate"] else "")
        best = r["best"]
        best_s = f"{best['usd_per_mtoken']:.3f} ({best['batch']})" if best and best["usd_per_mtoken"] else _FMT_NONE
        style = "dim" if r["support"] == "emulated" else None
        gpus = str(r["tp"]) + (f" {r['layout']}" if r["layout"] and not r["layout"].startswith("TP") else "")
        t.add_row(r["accelerator"], r["precision"], r["support"], _backend(r["backend"]),
                  "yes" if r["fits_one_gpu"] else "no", gpus,
                  price, *[_f(r["tokens_per_s"][str(b)]) for b in bs], best_s, style=style)
    con.print(t)
    con.print("[dim]— : the batch does not fit the KV cache at this context; * : estimated price; "
              "emulated rows are slower (see data/precisions.toml); backend 'measured' = aiconfigurator-core's "
              "profiled tables, 'roofline' = the formula (not covered: see --json backend_source).[/dim]")
    rk = Table(title="Accelerators ranked by their best $/Mtoken (native precisions)")
    for col in ("#", "accelerator", "precision", "TP", "batch", "tok/s", "$/Mtoken"):
        rk.add_column(col, justify="right" if col not in ("accelerator", "precision") else "left")
    for i, r in enumerate(rep["ranking"], 1):
        rk.add_row(str(i), r["accelerator"], r["precision"] or _FMT_NONE, _f(r["tp"], "d"), _f(r.get("batch"), "d"),
                   _f(r.get("tokens_per_s")), _f(r["usd_per_mtoken"], ".3f"))
    con.print(rk)
    if rep["needs_tp"]:
        con.print("Need TP > 1 (do not fit on one GPU): " +
                  ", ".join(f"{x['accelerator']}-{x['precision']} (TP {x['tp']})" for x in rep["needs_tp"]))
    else:
        con.print("Every pair fits on one GPU.")
    for x in rep["no_fit"]:
        con.print(f"[red]Does not fit at any TP:[/red] {x['error']}")


def _print_capacity(rep: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"[bold]{rep['model']}[/bold] on {rep['accelerator']} x{rep['n_gpus']} {rep['layout']} "
              f"({rep['precision']} weights, "
              f"{rep['kv_dtype']} KV{', emulated' if rep['emulated'] else ''}): "
              f"weights {rep['weight_gb']:.1f} GB, KV capacity {rep['kv_capacity_tokens']:,} tokens, "
              f"${rep['price_usd_per_hour']:.2f}/h{' (estimate)' if rep['price_estimate'] else ''}, "
              f"cold start {rep['cold_start_s']:.0f} s, weight sync {rep['weight_sync_s']:.1f} s")
    con.print(f"priced by: [bold]{_backend(rep['backend'])}[/bold] ({rep['backend_source'] or 'the formula'})")
    ctxs = sorted({g["context"] for g in rep["grid"]})
    bs = sorted({g["batch"] for g in rep["grid"]})
    cell = {(g["context"], g["batch"]): g for g in rep["grid"]}
    t = Table(title="Generated tokens/s (and $/Mtoken) vs batch and context; — = exceeds KV capacity")
    t.add_column("batch", justify="right")
    for c in ctxs:
        t.add_column(f"ctx {c:,} (max batch {rep['max_batch'][str(c)]})", justify="right")
    for b in bs:
        row = []
        for c in ctxs:
            g = cell[(c, b)]
            row.append(f"{g['tokens_per_s']:,.0f} (${g['usd_per_mtoken']:.2f})" if g["fits_kv"] else _FMT_NONE)
        t.add_row(str(b), *row)
    con.print(t)
    p = Table(title="Prefill (one request, empty cache)")
    p.add_column("new tokens", justify="right")
    p.add_column("seconds", justify="right")
    for x in rep["prefill"]:
        p.add_row(f"{x['new_tokens']:,}", f"{x['seconds']:.4f}")
    con.print(p)
    _print_layouts(con, rep)


def _backend(b: str | None) -> str:
    return {"aiconfigurator": "measured", "roofline": "roofline"}.get(b or "", b or "")


def _print_layouts(con: Any, rep: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(title=f"Layouts side by side at mean context {rep['layout_context']:,} tokens "
                    f"(best batch per layout; * = this replica's layout)")
    for col in ("layout", "GPUs", "KV capacity", "batch", "tok/s", "tok/s/GPU", "$/Mtoken", "backend"):
        t.add_column(col, justify="left" if col in ("layout", "backend") else "right")
    for x in rep["layouts"]:
        name = x["layout"] + (" *" if x["chosen"] else "")
        if not x["fits"]:
            t.add_row(name, str(x["gpus"]), f"{x['kv_capacity_tokens']:,}", "does not fit", "", "", "", "",
                      style="dim")
            continue
        t.add_row(name, str(x["gpus"]), f"{x['kv_capacity_tokens']:,}", str(x["batch"]), _f(x["tokens_per_s"]),
                  _f(x["tokens_per_s_per_gpu"]), _f(x["usd_per_mtoken"], ".3f"), _backend(x["backend"]))
    con.print(t)
