"""`mixfleet` commands: plan, simulate, compare: the mix planner and the twin (dry runs).

Rendering only: the work is in `mixfleet.twin` (planner.py, sim.py). Bad names, files or values print
one clear line (the field, the value, what is allowed) and exit with code 2, never a traceback.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import typer


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(code=2)


def _num(x: Any, spec: str = ",.2f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    if spec.endswith("f") and 0 < abs(x) < 0.1:
        return format(x, ".3g")  # small costs (CPU plans) keep their digits
    return format(x, spec)


STEADY_ROWS = (("steady time/update s", "steady_time_per_update_s", "steady_time_per_update_ci_s", ",.0f"),
               ("steady cost/update USD", "steady_cost_per_update_usd", "steady_cost_per_update_ci_usd", ",.2f"),
               ("  samplers", "steady_cost_sampler_per_update_usd", "steady_cost_sampler_per_update_ci_usd", ",.2f"),
               ("steady staleness", "steady_staleness_mean", "steady_staleness_ci", ".2f"))


def _pm(x: Any, half: Any, spec: str) -> str:
    """`x +- half` ("x" alone when the interval is unknown)."""
    if half is None or (isinstance(half, float) and not math.isfinite(half)):
        return _num(x, spec)
    return f"{_num(x, spec)} ± {_num(half, spec)}"


def _caps(items: list[str]) -> dict[str, int]:
    from mixfleet.costmodel.errors import SpecError

    out = {}
    for it in items:
        name, _, n = it.partition("=")
        if not n.strip().isdigit():
            raise SpecError("command line", "--max-gpus", it, "ACCELERATOR=GPUS, e.g. H100=32")
        out[name.strip()] = int(n)
    return out


def _pairs(items: list[str], flag: str, example: str) -> dict[str, str]:
    """ACCELERATOR=VALUE items (a repeatable option) as a dict; each accelerator at most once."""
    from mixfleet.costmodel.errors import SpecError

    out: dict[str, str] = {}
    for it in items:
        name, eq, value = (x.strip() for x in it.partition("="))
        if not eq or not name or not value:
            raise SpecError("command line", flag, it, f"ACCELERATOR=VALUE, e.g. {example}")
        if name in out:
            raise SpecError("command line", flag, it, f"each accelerator once ({name} is given twice)")
        out[name] = value
    return out


def _prices(items: list[str]) -> dict[str, float]:
    from mixfleet.costmodel.errors import SpecError

    out = {}
    for name, value in _pairs(items, "--price", "H100=3.0").items():
        try:
            out[name] = float(value)
        except ValueError:
            raise SpecError("command line", "--price", f"{name}={value}",
                            "ACCELERATOR=USD per GPU-hour, e.g. H100=3.0") from None
    return out


def _precisions(items: list[str]) -> dict[str, tuple[str, ...]]:
    return {name: tuple(p.strip() for p in value.split(","))
            for name, value in _pairs(items, "--precisions", "B200=nvfp4,bf16").items()}


def _progress(total: int, label: str):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(label), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                    transient=True)


def _simulate(plan: str, updates: int, seed: int | None, out: str | None, price_table: str | None, label: str,
              calibration: Path | None = None, warm_start: bool = False, truth: Path | None = None):
    from mixfleet.costmodel.calibration.record import Calibration
    from mixfleet.twin.sim import simulate

    world = {"truth": Calibration.load(truth)} if truth is not None else {}   # the world's numbers, not the plan's
    with _progress(updates, label) as bar:
        task = bar.add_task(label, total=updates)
        if calibration is not None:  # fitted values (mixfleet calibrate) in place of the cost model's priors
            from mixfleet.twin.calibrated import simulate_calibrated

            return simulate_calibrated(plan, calibration, updates=updates, seed=seed, out=out, warm_start=warm_start,
                                       price_table=price_table, progress=lambda v: bar.update(task, completed=v),
                                       **world)
        return simulate(plan, updates=updates, seed=seed, out=out, price_table=price_table, warm_start=warm_start,
                        progress=lambda v: bar.update(task, completed=v), **world)


def _spot_source(cfg: Any) -> dict[str, Any]:
    """Where the spot figures come from: the price table's [spot.<table>] source and date, and per offered
    accelerator its spot price, preemption rate and whether they are estimates."""
    from mixfleet.costmodel.specs.catalog import load_catalog

    cat = load_catalog(cfg.price_table)
    return {"source": cat.spot_source, "date": cat.spot_date,
            "accelerators": {a: {"usd_per_gpu_hour": cat.spot(a).price_usd_per_gpu_hour,
                                 "on_demand_usd_per_gpu_hour": cat.accelerator(a).price_usd_per_gpu_hour,
                                 "preemptions_per_hour": (cfg.spot_preemptions_per_hour
                                                          if cfg.spot_preemptions_per_hour is not None
                                                          else cat.spot(a).spot_preemptions_per_hour),
                                 "estimate": cat.spot(a).price_estimate} for a in cfg.spot}}


def _plan_sandboxes(cfg: Any, plan: Any) -> dict[str, Any]:
    """The chosen plan's sandboxes: cap (and whether the user set it), start latency, price and its source."""
    from mixfleet.costmodel.plan.planspec import resolve_plan_sandbox
    from mixfleet.costmodel.specs.workload import load_workload

    sb = resolve_plan_sandbox(plan, load_workload(plan.workload))
    return {"cap": sb.max_live, "cap_given": cfg.sandbox_cap is not None, "start_s": sb.start_s,
            "usd_per_sandbox_hour": sb.usd_per_hour, "price_source": sb.price_source}


def _split_line(b: Any, plan: Any) -> str:
    """Cost per update split into sampling, training and sandboxes (the analytic screen), and the pool."""
    from mixfleet.costmodel.plan.planspec import resolve_plan_sandbox
    from mixfleet.costmodel.specs.workload import load_workload

    sb = resolve_plan_sandbox(plan, load_workload(plan.workload))
    wait = b.sandbox_wait_share
    return (f"cost/update split (analytic): sampling {_num(b.cost_sampling_per_update_usd)} + training "
            f"{_num(b.cost_training_per_update_usd)} + sandboxes {_num(b.cost_sandbox_per_update_usd)} USD; "
            f"sandboxes: cap {sb.max_live:,}, {_num(b.sandboxes_live, ',.0f')} live on average, pool wait share "
            f"{_num(wait, '.1%')}" + (" (the cap binds)" if wait > 1e-9 else "")
            + f", {sb.start_s:g} s to start, ${sb.usd_per_hour:.4g} per sandbox-hour ({sb.price_source})")


def _print_spot(result: Any, cfg: Any) -> None:
    """The spot mix beside the best on-demand one: mix, cost and time per update (twin where verified, else the
    screen), expected lost work per update; then the source and date of every spot figure."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"With and without spot (price table {cfg.price_table}; work in flight on a lost replica: "
                    f"{cfg.on_loss})")
    for col in ("", "mix", "cost/update USD", "time/update s", "preemptions/update", "lost replica-s/update",
                "lost share", "lost USD/update", "turns cut/update (twin)"):
        t.add_column(col, justify="left" if col in ("", "mix") else "right")
    for label, c in (("chosen", result.best), ("on-demand only", result.on_demand)):
        if c is None:
            continue
        v, lw = c.verified, c.lost_work
        cost = _pm(v["cost_per_update_usd"], v["cost_per_update_ci_usd"], ",.2f") if v else _num(c.cost_per_update_usd)
        tpu = _pm(v["time_per_update_s"], v["time_per_update_ci_s"], ",.0f") if v else _num(c.time_per_update_s, ",.0f")
        cut = _num(v["turns_lost"] / max(v["updates"], 1), ",.2f") if v else "—"
        t.add_row(label, ", ".join(f"{g} x{n}" for g, n in c.replicas.items()), cost, tpu,
                  _num(lw.get("preemptions_per_update"), ".3g"), _num(lw.get("lost_replica_s_per_update"), ".3g"),
                  _num(lw.get("lost_share"), ".2e"), _num(lw.get("lost_usd_per_update"), ".3g"), cut)
    Console().print(t)
    src = _spot_source(cfg)
    typer.echo(f"spot figures: {src['source']} ({src['date']}); per accelerator: " + "; ".join(
        f"{a} ${x['usd_per_gpu_hour']:.2f}/GPU-h (on-demand ${x['on_demand_usd_per_gpu_hour']:.2f}), "
        f"{x['preemptions_per_hour']:.2g} preemptions/replica-h{' (estimates)' if x['estimate'] else ''}"
        for a, x in src["accelerators"].items()))


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `mixfleet` app."""

    from mixfleet.planner.defaults import DEFAULTS as D  # one set of defaults with the app's Plan page

    @app.command("plan")
    def plan_cmd(
        model: str = typer.Option(D.model, "--model", "-m", help="Model spec name or TOML path."),
        workload: str = typer.Option(D.workload, "--workload", "-w", help="Workload name or TOML path."),
        price_table: str = typer.Option(D.price_table, "--price-table", "-p", help="Price table (modal, runpod)."),
        accelerators: str = typer.Option("", "--accelerators", help="Comma-separated pool (default: every GPU)."),
        max_gpus: list[str] = typer.Option([], "--max-gpus", help="Cap, ACCELERATOR=GPUS (repeatable)."),
        default_max_gpus: int = typer.Option(D.default_max_gpus, "--default-max-gpus",
                                             help="Cap for accelerators not named."),
        kv_dtypes: str = typer.Option(",".join(D.kv_dtypes), "--kv-dtypes", help="KV-cache dtypes to consider."),
        price: list[str] = typer.Option([], "--price", help="USD per GPU-hour over the price table, "
                                        "ACCELERATOR=USD (repeatable), e.g. H100=3.0."),
        precisions: list[str] = typer.Option([], "--precisions", help="Allowed weight precisions, "
                                             "ACCELERATOR=P1,P2 (repeatable; default: the native ones)."),
        emulated: bool = typer.Option(D.emulated, "--emulated", help="Let --precisions name emulated formats."),
        trainer: str = typer.Option(D.trainer_accelerator, "--trainer", help="Trainer accelerator."),
        trainer_gpus: int = typer.Option(D.trainer_gpus, "--trainer-gpus", help="Trainer GPUs."),
        max_staleness: float = typer.Option(D.max_staleness, "--max-staleness", help="Max mean staleness, versions."),
        max_time: float = typer.Option(D.max_time_per_update_s, "--max-time-per-update",
                                       help="Max seconds per update."),
        budget: float = typer.Option(D.max_usd_per_hour, "--budget",
                                    help="Max USD per hour (fleet + trainer, + sandboxes with --sandboxes)."),
        objective: str = typer.Option(D.objective, "--objective",
                                      help="cost_per_update | cost_per_effective_update."),
        verify: int = typer.Option(D.verify, "--verify", help="Best candidates the twin verifies in steady state and "
                                   "re-ranks (0: none)."),
        verify_updates: int = typer.Option(D.verify_updates, "--verify-updates", help="Updates per twin verification "
                                           "(0: 10 + prompts in flight / prompts per update; warm start)."),
        verify_seeds: int = typer.Option(D.verify_seeds, "--verify-seeds", help="Seeds per verified candidate "
                                         "(--seed, --seed + 1, ...; the figures are their means)."),
        seed: int = typer.Option(D.seed, "--seed", min=0, help="The plan's seed and the first twin check seed."),
        workers: int = typer.Option(D.workers, "--workers", min=0, help="Twin checks: 1 = this machine's cores as "
                                    "processes, each check read back from ~/.cache/mixfleet when its inputs were "
                                    "checked before (MIXFLEET_NO_CACHE=1: never); N > 1 = N Ray workers on a local "
                                    "Ray (0: this machine's CPUs); the same results."),
        address: str = typer.Option(None, "--address", help="Run the twin checks as Ray tasks on this Ray cluster "
                                    "(e.g. 10.0.0.1:6379) instead of a local one."),
        spot: bool = typer.Option(False, "--spot", help="Offer every accelerator's spot capacity where the price "
                                  "table has a spot price (data/accelerators.toml [spot.<table>]); the best "
                                  "on-demand mix is shown beside it."),
        spot_accelerators: str = typer.Option("", "--spot-accelerators", help="Offer spot capacity of these "
                                              "accelerators only (comma-separated)."),
        spot_rate: float = typer.Option(None, "--spot-preemptions-per-hour", help="Spot replicas' preemptions per "
                                        "replica-hour (default: the catalog's per accelerator); kept in the plan."),
        on_loss: str = typer.Option(D.on_loss, "--on-loss", help="Work in flight on a lost replica: resume "
                                    "(re-prefill elsewhere) | restart (the trajectory starts over); kept in the plan."),
        out: Path = typer.Option(None, "--out", "-o", help="Write the chosen plan here (TOML)."),
        pareto_n: int = typer.Option(12, "--pareto", help="Pareto rows to print."),
        layouts: str = typer.Option(D.layouts, "--layouts", help="smallest: the smallest TP that fits; cheapest: "
                                    "each group's cheapest layout per token (TP 1-8, attention DP + EP for MoE)."),
        backend: str = typer.Option(D.backend, "--backend", help="Replica step times: roofline, auto (measured "
                                    "aiconfigurator tables where they cover a group), aiconfigurator."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
        calibration: Path = typer.Option(None, "--calibration", "-c",
                                         help="Calibration file (mixfleet calibrate): fitted values in place of "
                                              "the cost model's priors for the groups and trainer it covers."),
        sandboxes: bool = typer.Option(False, "--sandboxes", help="Each episode holds a sandbox (its start latency, "
                                       "priced per sandbox-hour, the pool sized with the fleet unless "
                                       "--sandbox-cap); any --sandbox-* option turns this on."),
        sandbox_cap: int = typer.Option(None, "--sandbox-cap", help="Most sandboxes live at once (e.g. a "
                                        "provider's concurrency limit): episodes queue for one beyond it."),
        sandbox_start_s: float = typer.Option(None, "--sandbox-start-s", help="Seconds a sandbox takes to start "
                                              "(default 10, an estimate)."),
        sandbox_price: float = typer.Option(None, "--sandbox-price", help="USD per sandbox-hour (default: the "
                                            "catalog's [sandbox] price, data/accelerators.toml)."),
    ) -> None:
        """Find the fleet mix with the lowest cost per (effective) update under the constraints."""
        from mixfleet.costmodel.errors import SpecError
        from mixfleet.costmodel.jsonsafe import json_safe
        from mixfleet.planner.config import PlannerConfig
        from mixfleet.planner.search import binds_text, plan_mix
        from mixfleet.policies.plan import save_plan
        from rich.console import Console
        from rich.table import Table

        console = Console(stderr=True)
        try:
            cal = None
            if calibration is not None:
                from mixfleet.costmodel.calibration.record import Calibration

                cal = Calibration.load(calibration)
            cfg = PlannerConfig(calibration=cal, model=model, workload=workload, price_table=price_table,
                                accelerators=tuple(a.strip() for a in accelerators.split(",") if a.strip()),
                                max_gpus=_caps(max_gpus), default_max_gpus=default_max_gpus,
                                kv_dtypes=tuple(k.strip() for k in kv_dtypes.split(",") if k.strip()),
                                trainer_accelerator=trainer, trainer_gpus=trainer_gpus, max_staleness=max_staleness,
                                max_time_per_update_s=max_time, max_usd_per_hour=budget, objective=objective,
                                verify=verify, verify_updates=verify_updates, prices=_prices(price),
                                precisions=_precisions(precisions), emulated=emulated, layouts=layouts,
                                backend=backend, seed=seed, verify_seeds=verify_seeds, on_loss=on_loss,
                                spot=("all",) if spot else tuple(a.strip() for a in spot_accelerators.split(",")
                                                                 if a.strip()),
                                spot_preemptions_per_hour=spot_rate,
                                sandboxes=sandboxes or sandbox_start_s is not None, sandbox_cap=sandbox_cap,
                                sandbox_usd_per_hour=sandbox_price,
                                **({"sandbox_start_s": sandbox_start_s} if sandbox_start_s is not None else {}))
            from mixfleet.twin.checks import default_map, twin_check

            check_map = default_map   # this machine's cores, each check read back when it was checked before
            if workers != 1 or address:   # the twin checks as Ray tasks (runner/orchestration/ray_map.py)
                import functools

                from mixfleet.runner.orchestration.ray_map import ray_map

                check_map = functools.partial(ray_map, workers=workers, address=address)
            wall0 = time.perf_counter()
            with console.status("planning") as status:
                result = plan_mix(cfg, progress=lambda m: status.update(f"planning: {m}"), check=twin_check,
                                  check_map=check_map)
            wall_s = time.perf_counter() - wall0
        except (SpecError, FileNotFoundError) as e:
            _fail(e)
        if cal is not None:
            from mixfleet.planner.fleet import calibrated_group

            covered = [t.name for t in result.types if calibrated_group(cal, t.accelerator, t.precision, t.kv_dtype)]
            typer.echo(f"calibrated planner: fitted values from {calibration} in place of the priors for "
                       f"{', '.join(covered) or 'no group of this pool'}"
                       + (f" and the {cfg.trainer_accelerator} trainer" if cal.trainer_accelerator ==
                          cfg.trainer_accelerator else "") + "; the rest use the priors", err=True)
        if result.best is None:
            typer.echo(f"no plan: {result.note}", err=True)
            raise typer.Exit(code=1)
        if out is not None:
            save_plan(result.plan, out)
        if as_json:
            typer.echo(json.dumps(json_safe({
                "best": result.best.to_dict(), "pareto": [c.to_dict() for c in result.pareto],
                "verified": [c.to_dict() for c in result.verified], "screened": result.screened,
                "feasible": result.feasible, "plan_file": str(out) if out else None, "wall_s": wall_s,
                "checks": result.checks, "on_demand": result.on_demand.to_dict() if result.on_demand else None,
                "binds": [{"flag": x.flag, "what": x.what, "limit": x.limit, "relaxed_objective": x.relaxed_objective,
                           "relaxed_value": x.relaxed_value, "gain": x.gain, "text": x.text()} for x in result.binds],
                "spot_source": _spot_source(cfg) if cfg.spot else None,
                "sandboxes": _plan_sandboxes(cfg, result.plan) if cfg.sandboxes else None,
                "groups": {x.name: {"tp": x.tp, "dp_attention": x.dp_attention, "ep": x.ep, "backend": x.backend}
                           for x in result.types if x.name in result.best.replicas}}), indent=2))
            return
        b = result.best
        t = Table(title=f"Chosen mix ({cfg.objective}; {result.screened} candidates screened, {result.feasible} "
                        "feasible)")
        for col in ("group", "replicas", "GPUs", "layout", "tokens/s", "USD/h", "prior masked share", "priced by",
                    *(("preemptions / replica-h",) if cfg.spot else ())):
            t.add_column(col, justify="right" if col not in ("group", "layout", "priced by") else "left")
        types = {x.name: x for x in result.types}
        for g, n in b.replicas.items():
            x = types[g]
            lay = (f"TP{x.tp}" if x.dp_attention == 1 and x.ep == 1 else
                   f"TP{x.tp // x.dp_attention}-DP{x.dp_attention}-EP{x.ep}" if x.tp // x.dp_attention > 1
                   else f"DEP{x.tp}")
            t.add_row(g, str(n), str(n * x.tp), lay, _num(n * x.tokens_per_s, ",.0f"), _num(n * x.usd_per_hour),
                      _num(x.masked_share, ".3%"), "measured" if x.backend == "aiconfigurator" else x.backend,
                      *((_num(x.preemptions_per_hour, ".2g") if x.spot else "on-demand",) if cfg.spot else ()))
        Console().print(t)
        lines = []
        if b.verified:
            v = b.verified
            lines.append(f"twin steady state (chosen plan, {v['updates']} updates: pipeline fill "
                         f"{_num(v['fill_s'], ',.0f')} s, warm-up {v['warmup_updates']}, {v['steady_updates']} "
                         "steady; ± 95% interval): "
                         f"time/update {_pm(v['time_per_update_s'], v['time_per_update_ci_s'], ',.0f')} s; "
                         f"cost/update {_pm(v['cost_per_update_usd'], v['cost_per_update_ci_usd'], ',.2f')} USD "
                         "(samplers "
                         f"{_pm(v['cost_sampler_per_update_usd'], v['cost_sampler_per_update_ci_usd'], ',.2f')}"
                         + ("; sandboxes " + _pm(v["cost_sandbox_per_update_usd"], v["cost_sandbox_per_update_ci_usd"],
                                                 ",.2f")
                            + f", pool wait share {_num(v['sandbox_wait_share'], '.1%')}" if cfg.sandboxes else "")
                         + ")"
                         f"; staleness {_pm(v['staleness'], v['staleness_ci'], '.2f')}; "
                         f"throughput {_num(v['tokens_per_s'], ',.0f')} tok/s"
                         + ("" if v["feasible"] else "; MISSES a constraint in the twin"))
        lines.append(f"analytic screen: prompts in flight {b.inflight_prompts}; throughput "
                     f"{_num(b.throughput_tokens_per_s, ',.0f')} tok/s; "
                     f"time/update {_num(b.time_per_update_s, ',.0f')} s; "
                     f"staleness {_num(b.staleness, '.2f')}; USD/h {_num(b.usd_per_hour)}; cost/update "
                     f"{_num(b.cost_per_update_usd)}; cost/effective update {_num(b.cost_per_effective_update_usd)}"
                     + ("; trainer-bound" if b.trainer_bound else ""))
        if cfg.sandboxes:
            lines.append(_split_line(b, result.plan))
        lines.append(f"what binds: {binds_text(result.binds)}")
        if cfg.prices:
            lines.append("prices over the table (USD per GPU-hour): "
                         + ", ".join(f"{a} {usd:.2f}" for a, usd in cfg.prices.items()))
        for line in lines:
            typer.echo(line)
        if result.verified:
            vt = Table(title=f"Verified in the twin's steady state and re-ranked ({len(result.verified)} best by the "
                             "analytic screen; ± 95% interval)")
            for col in ("rank", "cost/update USD (twin)", "time/update s (twin)", "staleness (twin)",
                        "analytic cost / time / staleness", "in flight", "mix"):
                vt.add_column(col, justify="left" if col == "mix" else "right")
            for i, c in enumerate(result.verified):
                v = c.verified
                vt.add_row(str(i + 1) + ("" if v["feasible"] else " (misses a constraint)"),
                           _pm(v["cost_per_update_usd"], v["cost_per_update_ci_usd"], ",.2f"),
                           _pm(v["time_per_update_s"], v["time_per_update_ci_s"], ",.0f"),
                           _pm(v["staleness"], v["staleness_ci"], ".2f"),
                           f"{_num(c.cost_per_update_usd)} / {_num(c.time_per_update_s, ',.0f')} / "
                           f"{_num(c.staleness, '.2f')}", str(c.inflight_prompts),
                           ", ".join(f"{g} x{n}" for g, n in c.replicas.items()))
            Console().print(vt)
        p = Table(title="Pareto set (cost/update vs time/update vs staleness)")
        for col in ("cost/update USD", "time/update s", "staleness", "in flight", "mix"):
            p.add_column(col, justify="right" if col != "mix" else "left")
        for c in result.pareto[:pareto_n]:
            p.add_row(_num(c.cost_per_update_usd), _num(c.time_per_update_s, ",.0f"), _num(c.staleness, ".2f"),
                      str(c.inflight_prompts), ", ".join(f"{g} x{n}" for g, n in c.replicas.items()))
        Console().print(p)
        if cfg.spot:
            _print_spot(result, cfg)
        ch = result.checks
        if ch:
            n_cands = ch["tasks"] // cfg.verify_seeds
            typer.echo(f"twin checks: {ch['tasks']} ({n_cands} candidates x {cfg.verify_seeds} seeds) on "
                       f"{ch['workers']} worker{'s' if ch['workers'] != 1 else ''}"
                       + (f" ({ch['nodes']} nodes, Ray at {ch['address']})" if ch["mode"] == "ray" else
                          " (processes on this machine)" if ch["mode"] == "processes" else
                          " (in this process, one after another)")
                       + (f", {ch['cached']} read from the cache" if ch.get("cached") else "")
                       + f", {ch['wall_s']:,.1f} s wall")
        typer.echo(f"planned in {wall_s:,.1f} s wall ({result.screened} candidates screened, "
                   f"{len(result.verified)} verified in the twin)")
        if out is not None:
            typer.echo(f"plan written to {out}")

    @app.command("simulate")
    def simulate_cmd(
        plan: str = typer.Argument(..., help="Plan TOML path or shipped plan name (e.g. seed-mixed)."),
        updates: int = typer.Option(10, "--updates", "-n", help="Trainer updates to simulate."),
        out: Path = typer.Option(None, "--out", "-o", help="Run-log folder, new or empty (default: a temporary one)."),
        force: bool = typer.Option(False, "--force", help="Replace the dry run already in --out (never a folder "
                                                          "mixfleet did not write)."),
        seed: int = typer.Option(None, "--seed", min=0, help="Override the plan's seed (an integer >= 0)."),
        price_table: str = typer.Option(None, "--price-table", "-p", help="Override the plan's price table."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
        calibration: Path = typer.Option(None, "--calibration", "-c",
                                         help="Calibration TOML (mixfleet calibrate): replaces the priors."),
        warm_start: bool = typer.Option(False, "--warm-start", help="Begin near the steady state (prompt-groups "
                                        "at the ages the workload implies), so fewer updates measure it."),
        truth: Path = typer.Option(None, "--truth", help="Calibration TOML the simulated world runs on, while the "
                                   "plan and its re-planner (autoscaler replan) start from the priors "
                                   "(or --calibration): the re-planning loop's test bench."),
    ) -> None:
        """Dry-run a plan in the twin: run log + summary."""
        from mixfleet.costmodel.errors import SpecError
        from mixfleet.costmodel.records.outdir import claim_output_dir

        lock = None
        try:                  # one writer per run-log folder, as `mixfleet run`: held until the log is closed
            if out is not None:
                lock = claim_output_dir(out, "twin_runlog", where="mixfleet simulate", force=force)
            r = _simulate(plan, updates, seed, str(out) if out else None, price_table, "simulating", calibration,
                          warm_start=warm_start, truth=truth)
        except (SpecError, FileNotFoundError) as e:
            _fail(e)
        finally:
            if lock is not None:
                lock.release()
        if as_json:
            typer.echo(json.dumps(r.to_dict(), indent=2))
            return
        _print_summaries([(Path(plan).stem, r)])
        if (line := _sandbox_line(plan)) is not None:
            typer.echo(line)
        if calibration is not None:
            typer.echo(f"calibrated twin: fitted values from {calibration} in place of the cost model's priors")
        if truth is not None:
            typer.echo(f"truth: the world ran on {truth}; the plan and its re-planner started from "
                       f"{calibration or 'the priors'}")
        typer.echo(f"simulated {r.simulated_s:,.0f} s in {r.wall_s:,.1f} s wall ({r.events:,} events, "
                   f"{r.events_per_s:,.0f}/s); run log: {r.runlog_dir or '(not kept; pass --out)'}")

    @app.command("compare")
    def compare_cmd(
        a: str = typer.Argument(..., help="First plan (TOML path or shipped name)."),
        b: str = typer.Argument(..., help="Second plan."),
        updates: int = typer.Option(6, "--updates", "-n", help="Trainer updates to simulate each."),
        seed: int = typer.Option(None, "--seed", min=0, help="Override the plans' seed (an integer >= 0)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
        warm_start: bool = typer.Option(False, "--warm-start", help="Begin both near the steady state."),
    ) -> None:
        """Dry-run two plans and put them side by side."""
        from mixfleet.costmodel.errors import SpecError

        try:
            ra = _simulate(a, updates, seed, None, None, f"simulating {Path(a).stem}", warm_start=warm_start)
            rb = _simulate(b, updates, seed, None, None, f"simulating {Path(b).stem}", warm_start=warm_start)
        except (SpecError, FileNotFoundError) as e:
            _fail(e)
        if as_json:
            typer.echo(json.dumps({Path(a).stem: ra.to_dict(), Path(b).stem: rb.to_dict()}, indent=2))
            return
        _print_summaries([(Path(a).stem, ra), (Path(b).stem, rb)])
        for p in (a, b):
            if (line := _sandbox_line(p)) is not None:
                typer.echo(line)


def _has_sandboxes(summary: Any) -> bool:
    """Whether a run held sandboxes (a plan's [sandbox] table): its pool-wait share is measured."""
    return math.isfinite(summary.sandbox_wait_share) or summary.cost_sandbox_per_update_usd > 0


def _sandbox_line(plan: str) -> str | None:
    """The plan's sandboxes in one line (cap, start latency, price and its source); None without a [sandbox]."""
    from mixfleet.costmodel.plan.planspec import resolve_plan_sandbox
    from mixfleet.costmodel.specs.workload import load_workload
    from mixfleet.policies.plan import load_plan

    p = load_plan(plan)
    sb = resolve_plan_sandbox(p, load_workload(p.workload))
    if sb is None:
        return None
    return (f"sandboxes of {Path(plan).stem}: one per episode, at most {sb.max_live:,} live, {sb.start_s:g} s to "
            f"start, ${sb.usd_per_hour:.4g} per sandbox-hour ({sb.price_source})")


def _print_summaries(runs: list[tuple[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Twin dry run ({runs[0][1].updates} updates; steady state: after the pipeline fill and the "
                    "MSER-5 warm-up, +- 95% batch-means interval)")
    t.add_column("metric")
    for name, _ in runs:
        t.add_column(name, justify="right")
    sandboxes = any(_has_sandboxes(r.summary) for _, r in runs)   # a run without them: the table as before
    for label, field, ci, spec in STEADY_ROWS:
        t.add_row(label, *(_pm(getattr(r.summary, field), getattr(r.summary, ci), spec) for _, r in runs))
        if sandboxes and field == "steady_cost_sampler_per_update_usd":
            t.add_row("  sandboxes", *(_pm(r.summary.steady_cost_sandbox_per_update_usd,
                                           r.summary.steady_cost_sandbox_per_update_ci_usd, spec) for _, r in runs))
    t.add_row("steady tokens/s", *(_num(r.summary.steady_tokens_per_s, ",.0f") for _, r in runs))
    t.add_row("pipeline fill s (start to update 1)", *(_num(r.summary.first_update_s, ",.0f") for _, r in runs))
    t.add_row("warm-up / steady updates", *(f"{r.summary.warmup_updates} / {r.summary.steady_updates}"
                                            for _, r in runs))
    rows = [("whole run, incl. fill:", "", ""),
            ("cost/update USD", "cost_per_update_usd", ",.2f"), ("  samplers", "cost_sampler_per_update_usd", ",.2f"),
            ("  trainer", "cost_trainer_per_update_usd", ",.2f"), ("time/update s", "time_per_update_mean_s", ",.0f"),
            ("time/update p95 s", "time_per_update_p95_s", ",.0f"), ("staleness mean", "staleness_mean", ".2f"),
            ("staleness p95", "staleness_p95", ".2f"), ("trainer idle", "trainer_idle_share", ".1%"),
            ("utilization", "utilization", ".1%"), ("tokens/s", "tokens_per_s", ",.0f"),
            ("KL k3 (prior)", "kl_k3", ".2e"), ("extreme share (prior)", "extreme_share", ".3%")]
    if sandboxes:
        at = [r[1] for r in rows].index("cost_trainer_per_update_usd") + 1
        rows[at:at] = [("  sandboxes", "cost_sandbox_per_update_usd", ",.2f"),
                       ("sandbox pool wait share", "sandbox_wait_share", ".1%")]
    for label, field, spec in rows:
        t.add_row(label, *(_num(getattr(r.summary, field, None), spec) if field else "" for _, r in runs))
    groups = sorted({g for _, r in runs for g in r.summary.group_share_of_samples})
    for g in groups:
        t.add_row(f"share of samples: {g}",
                  *(_num(r.summary.group_share_of_samples.get(g), ".1%") for _, r in runs))
    Console().print(t)
