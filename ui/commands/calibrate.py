"""`mixfleet` commands: calibrate (fit the cost model to run logs) and fidelity (the twin vs a real run).

Rendering only: the fit is `mixfleet.costmodel.calibration`, the calibrated twin and the comparison are
`mixfleet.twin.calibrated`. Bad input prints one line (field, value, what is allowed) and exits with 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from mixfleet.costmodel.jsonsafe import json_safe


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(code=2)


def _fmt(x: float, spec: str = ".4g") -> str:
    return "—" if x is None or not math.isfinite(x) else format(x, spec)


def register(app: typer.Typer) -> None:
    """Add `calibrate` and `fidelity` to the `mixfleet` app."""

    @app.command("calibrate")
    def calibrate_cmd(
        runlogs: list[Path] = typer.Argument(None, help="Run-log folders (real or twin) of one model and trainer."),
        measurements: Path = typer.Option(None, "--measurements", help="Instead of run logs: fit the roofline's "
                                          "efficiency factors to published GPU measurements (a folder or file, e.g. "
                                          "data/measurements/), judged leave-one-source-out."),
        out: Path = typer.Option(None, "--out", "-o", help="Write the calibration here (TOML)."),
        workload_out: Path = typer.Option(None, "--workload-out", "-w", help="Fit the workload of real runs with "
                                          "tools (command seconds, turns, tool-output tokens, sandbox start), each "
                                          "with a 95% interval, and write it here as a workload TOML that "
                                          "simulate and plan take; without --out only this fit runs."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Fit the cost model's free parameters to run logs: each value with its uncertainty and the residuals
        (or, with --measurements, the roofline's factors to published figures; with --workload-out, the
        workload the runs had)."""
        from mixfleet.costmodel.calibration.fit import calibrate
        from mixfleet.costmodel.calibration.record import calibration_dict
        from mixfleet.costmodel.errors import SpecError

        if measurements is not None:
            _fit_measurements(measurements, out, as_json)
            return
        if not runlogs:
            _fail(SpecError("command line", "RUNLOGS", None, "one or more run-log folders, or --measurements DIR"))
        if workload_out is not None:
            _fit_workload(runlogs, workload_out, as_json and out is None)
            if out is None:
                return
        try:
            cal = calibrate(runlogs)
        except (SpecError, FileNotFoundError, OSError) as e:
            _fail(e)
        if out is not None:
            cal.save(out)
        if as_json:
            body = {**calibration_dict(cal), "written_to": str(out) if out else None}
            typer.echo(json.dumps(json_safe(body), indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"Calibration from {cal.counts.get('runs', 0)} run log(s): {cal.counts.get('updates', 0)} "
                        f"updates, {cal.counts.get('trajectories', 0)} trajectories")
        for col in ("scope", "parameter", "fitted", "± 1σ", "prior", "unit", "note"):
            t.add_column(col, justify="right" if col in ("fitted", "± 1σ", "prior") else "left")
        for scope, name, f in cal.table():
            t.add_row(scope, name, _fmt(f.value), _fmt(f.stderr) if f.fitted else "(not fitted)", _fmt(f.prior),
                      f.unit, f.note)
        Console().print(t)
        typer.echo("residuals: " + ", ".join(f"{k} {_fmt(v, '.3g')}" for k, v in cal.residuals.items()))
        if cal.workload:
            w = cal.workload
            typer.echo(f"measured workload: {len(w['turns']['values'])} trajectories' turns, tool output "
                       f"{_fmt(w['tool_output_tokens']['value'], '.1f')} tokens/turn, turn latency "
                       f"{_fmt(w['tool_latency_s']['value'], '.3g')} s")
        if out is not None:
            typer.echo(f"calibration written to {out} (use: mixfleet fidelity PLAN --runlog RUN --calibration {out})")

    @app.command("fidelity")
    def fidelity_cmd(
        plan: str = typer.Argument(None, help="The plan to simulate (TOML path or shipped name; default: the plan "
                                             "recorded in the run log)."),
        runlog: Path = typer.Option(..., "--runlog", "-r", help="The measured run log folder."),
        calibration: Path = typer.Option(None, "--calibration", "-c", help="Calibration TOML (default: priors)."),
        keep: Path = typer.Option(None, "--keep-twin-log", help="Keep the twin's run log in this folder."),
        workload: Path = typer.Option(None, "--workload", "-w", help="Workload TOML the twin draws episodes from "
                                      "(e.g. mixfleet calibrate --workload-out's fit; default: the calibration's, "
                                      "else the plan's)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Simulate PLAN as the run ran it (seed, updates, replicas, workload); predicted vs measured (with
        sandboxes also the pool-wait share and the sandbox cost per update)."""
        from mixfleet.costmodel.errors import SpecError
        from mixfleet.costmodel.records.outdir import prepare_output_dir
        from mixfleet.twin.calibrated import fidelity

        try:
            if keep is not None:
                prepare_output_dir(keep, "twin_runlog", where="mixfleet fidelity", flag="--keep-twin-log")
            rep = fidelity(plan, runlog, calibration, keep_twin_log=keep, workload=workload)
        except (SpecError, FileNotFoundError, OSError) as e:
            _fail(e)
        if as_json:
            typer.echo(json.dumps(json_safe(rep.to_dict()), indent=2))
            return
        from rich.console import Console
        from rich.table import Table

        src = f"calibration {rep.calibration}" if rep.calibration else "priors (no calibration)"
        label = Path(rep.plan).stem if plan else rep.plan
        t = Table(title=f"Fidelity: {label}, {rep.updates} updates, seed {rep.seed}; twin with {src}")
        for col in ("metric", "measured", "predicted", "error", "unit"):
            t.add_column(col, justify="left" if col in ("metric", "unit") else "right")
        for r in rep.rows:
            err = r.error
            shown = "—" if not math.isfinite(err) else (f"{err:+.1%}" if r.kind == "rel" else
                                                          f"{err:+.2f} pp" if r.kind == "pp" else f"{err:+.3g}")
            t.add_row(r.metric, _fmt(r.measured), _fmt(r.predicted), shown, r.unit)
        Console().print(t)
        g = rep.goals()
        typer.echo(f"goals: time/update within 10%: {g['time_per_update_within_10pct']}; share of samples within "
                   f"3 pp: {g['share_of_samples_within_3pp']}; staleness within 0.5: "
                   f"{g['staleness_within_half_update']}" + (
                       f"; pool-wait share within 5 pp: {g['sandbox_wait_share_within_5pp']}; sandbox cost/update "
                       f"within 10%: {g['cost_sandbox_per_update_within_10pct']}" if "sandbox_wait_share_within_5pp"
                       in g else ""))
        for n in rep.notes:
            typer.echo(f"note: {n}")


def _fit_workload(runlogs: list[Path], out: Path, as_json: bool) -> None:
    from mixfleet.costmodel.calibration.tool_fit import INTERVAL, fit_workload
    from mixfleet.costmodel.errors import SpecError

    for r in runlogs:
        if not r.is_dir():
            _fail(SpecError("command line", "RUNLOGS", str(r), "run-log folders"))
    try:
        fit = fit_workload(runlogs)
        fit.save(out)
    except (SpecError, FileNotFoundError, OSError) as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(json_safe({**fit.to_dict(), "written_to": str(out)}), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    c = fit.counts
    t = Table(title=f"Workload measured from {c['runs']} run log(s): {c['episodes']} episodes, {c['tool_calls']} "
                    f"tool calls, {c['sandbox_starts']} sandbox starts ({INTERVAL:.0%} bootstrap intervals)")
    for col in ("field", "parameter", "fitted", "interval", "n", "unit"):
        t.add_column(col, justify="left" if col in ("field", "parameter", "unit") else "right")
    for name, f in fit.fits.items():
        for label, e in (("median", f.median), ("mu (log median)", f.mu), ("sigma", f.sigma),
                         ("mean (sample)", f.mean)):
            t.add_row(name if label == "median" else "", label, _fmt(e.value),
                      f"[{_fmt(e.lo)}, {_fmt(e.hi)}]", str(e.n), e.unit)
    for name, e in fit.figures.items():
        t.add_row(name, "", _fmt(e.value), f"[{_fmt(e.lo)}, {_fmt(e.hi)}]", str(e.n), e.unit)
    Console().print(t)
    p = fit.pool
    typer.echo(f"sandbox pool: {p['sandboxes']} sandboxes, {p['waits_over_1ms']} waited > 1 ms, "
               f"{_fmt(p['wait_s_total'], '.3g')} s of waits in {_fmt(p['episode_s_total'], '.4g')} episode-seconds")
    for n in fit.notes:
        typer.echo(f"note: {n}")
    typer.echo(f"workload written to {out} (use: mixfleet plan --workload {out}, or a plan's workload = \"{out}\")")


def _fit_measurements(path: Path, out: Path | None, as_json: bool) -> None:
    from mixfleet.costmodel.errors import SpecError
    from mixfleet.costmodel.steptime.measurement_fit import fit_measurements
    from mixfleet.costmodel.steptime.measurements import load_measurements

    try:
        fit = fit_measurements(load_measurements(path))
    except (SpecError, FileNotFoundError, OSError) as e:
        _fail(e)
    if out is not None:
        fit.save(out)
    if as_json:
        typer.echo(json.dumps(json_safe({**fit.to_dict(), "written_to": str(out) if out else None}), indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Roofline factors fitted to published measurements per (GPU arch, model kind, precision)")
    for col in ("arch", "kind", "precision", "rows", "parameter", "fitted", "± 1σ", "prior"):
        t.add_column(col, justify="left" if col in ("arch", "kind", "precision", "parameter") else "right")
    for g in fit.groups.values():
        for i, (k, v) in enumerate(g.values.items()):
            t.add_row(g.arch if i == 0 else "", g.kind if i == 0 else "", g.precision if i == 0 else "",
                      str(g.n_rows) if i == 0 else "", k, _fmt(v) if g.fitted else "(not fitted)",
                      _fmt(g.stderr[k]) if g.fitted else "", _fmt(g.priors[k]))
    Console().print(t)

    def line(name: str, s: dict) -> str:
        return (f"{name}: {s['n']} rows, median factor {_fmt(s['median_factor'], '.3g')}, worst "
                f"{_fmt(s['worst_factor'], '.3g')}")

    typer.echo(line("in sample (fitted)", fit.in_sample))
    typer.echo(line("out of sample (leave one source out, fitted)", fit.out_of_sample))
    typer.echo(line("priors on the same rows", fit.priors_same_rows))
    for src, d in fit.per_source.items():
        held, pri = d["fitted_held_out"], d["priors"]
        typer.echo(f"  held out {src}: fitted {_fmt(held['median_factor'], '.3g')} / "
                   f"{_fmt(held['worst_factor'], '.3g')}, priors {_fmt(pri['median_factor'], '.3g')}"
                   f" / {_fmt(pri['worst_factor'], '.3g')} (median / worst factor)")
    typer.echo("ships: " + ("yes, the fitted factors beat the priors out of sample" if fit.ships else
                            "no, the fitted factors do not beat the priors out of sample on both median and worst"))
    if out is not None:
        typer.echo(f"fit written to {out} (compare: mixfleet validate-costmodel --calibration {out})")
