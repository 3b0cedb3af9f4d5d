"""`mixfleet experiment ablation` and `mixfleet report ablation`: the corrections ablation study (docs/ablation/).

`experiment ablation` runs the six loss variants (studies/ablation.py) on the mixed and/or homogeneous
fleet for the given seeds, one real run each, resumable; `report ablation DIR` reads their run logs and
writes Markdown + plots (studies/ablation_report.py). Heavy imports happen inside the commands.
"""

from __future__ import annotations

from pathlib import Path

import typer

experiment_app = typer.Typer(help="Studies made of several real runs.", no_args_is_help=True)
report_app = typer.Typer(help="Reports over a study's run logs.", no_args_is_help=True)


def _fail(msg: str) -> None:
    typer.secho(f"error: {msg}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _ints(text: str, name: str) -> tuple[int, ...]:
    """"0,1" or "2" (a count: seeds 0..N-1)."""
    text = text.strip()
    try:
        if "," in text or "-" in text:
            return tuple(int(x) for x in text.split(",") if x.strip())
        n = int(text)
    except ValueError:
        _fail(f"{name} = {text!r}; allowed: a count N (seeds 0..N-1) or a comma list such as 0,1")
    if n < 1:
        _fail(f"{name} = {text!r}; allowed: a count >= 1 (seeds 0..N-1) or a comma list (one seed alone: "
              f"'{text},')")
    return tuple(range(n))


@experiment_app.command("ablation")
def ablation(
    fleet: str = typer.Option("both", "--fleet", help="mixed | homogeneous | both | mixed-moe | mixed-moe-replay | "
                                                       "moe (the two mixed-moe fleets)."),
    updates: int = typer.Option(30, "--updates", "-n", min=1, help="Trainer updates per run."),
    seeds: str = typer.Option("2", "--seeds", help="A count N (seeds 0..N-1) or a comma list (0,3)."),
    out: Path = typer.Option(Path("runs/ablation"), "--out", "-o", help="Study folder (one run log per run)."),
    resume: bool = typer.Option(False, "--resume", help="Continue unfinished runs (finished ones are skipped)."),
    variants: str = typer.Option("all", "--variants", help="Comma list of variants (grpo, grpo_mis, sc, grpo_topp, "
                                                           "sc_mis, sc_mis_topp) or all."),
    parallel: int = typer.Option(1, "--parallel", min=1, help="Runs at once (1 on a small CPU machine)."),
    init: str = typer.Option("", "--init", help="Base policy checkpoint (default: the cached `mixfleet pretrain`)."),
    lr: float = typer.Option(None, "--lr", help="Trainer learning rate for every run (default: the plans' own, "
                                                "tiny-cpu's 3e-4 with its warm-up)."),
    eval_every: int = typer.Option(10, "--eval-every", min=0, help="Held-out evaluations every N updates (0: none)."),
    mixed_plan: str = typer.Option("", "--mixed-plan", help="Plan for the mixed fleet (default ablation-mixed)."),
    homogeneous_plan: str = typer.Option("", "--homogeneous-plan",
                                         help="Plan for the homogeneous fleet (default ablation-homogeneous)."),
) -> None:
    """Run the six loss variants (GRPO, GRPO+MIS, SC, GRPO+top-p, SC+MIS, SC+MIS+top-p) with identical seeds,
    base policy, tasks and plan except the loss; one run log per (fleet, variant, seed) under --out."""
    from mixfleet.costmodel.errors import SpecError
    from mixfleet.studies.ablation import VARIANT_KEYS, AblationConfig, fleets_for, run_ablation

    plans = {k: v for k, v in (("mixed", mixed_plan), ("homogeneous", homogeneous_plan)) if v}
    try:
        cfg = AblationConfig(out_dir=out, fleets=fleets_for(fleet), seeds=_ints(seeds, "--seeds"), updates=updates,
                             resume=resume, parallel=parallel, base_policy=init, lr=lr, plans=plans,
                             eval_every=eval_every,
                             variants=VARIANT_KEYS if variants == "all" else
                             tuple(v.strip() for v in variants.split(",") if v.strip()))
        manifest = run_ablation(cfg, log=typer.echo)
    except (ValueError, SpecError) as e:
        _fail(str(e))
    bad = {k: v.get("status") for k, v in manifest["runs"].items() if v.get("state") != "finished"}
    if bad:
        typer.secho(f"{len(bad)} run(s) not finished: " + ", ".join(f"{k} ({v})" for k, v in bad.items())
                    + " - see driver.log in their folders; rerun with --resume", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(1)
    typer.echo(f"done: {len(manifest['runs'])} runs under {out}; report: mixfleet report ablation {out}")


@report_app.command("ablation")
def report_ablation(
    folder: Path = typer.Argument(..., help="The study folder (--out of `mixfleet experiment ablation`)."),
    out: Path = typer.Option(None, "--out", "-o", help="Where README.md and the plots go (default: FOLDER/report)."),
    notes: Path = typer.Option(None, "--notes", help="A Markdown file to put first (the study's findings)."),
    no_plots: bool = typer.Option(False, "--no-plots", help="Markdown only."),
    include_unfinished: bool = typer.Option(False, "--include-unfinished", help="Also report runs still running or "
                                                                                "killed (left out by default)."),
    seeds: str = typer.Option("", "--seeds", help="Only these seeds (comma list; default: all found)."),
) -> None:
    """Report the study: per variant over updates (reward, KL, extreme ratios, grad norm, entropy, episodes without
    tool calls), a verdict per run by a stated rule, per group shares; Markdown + PNG (or HTML) plots."""
    from mixfleet.studies.ablation_report import build_report

    if not folder.is_dir():
        _fail(f"report folder {str(folder)!r} does not exist; allowed: the --out folder of an ablation study")
    dest = out or folder / "report"
    try:
        only = tuple(int(x) for x in seeds.split(",") if x.strip()) if seeds else None
    except ValueError:
        _fail(f"--seeds = {seeds!r}; allowed: a comma list of integers such as 0,1")
    try:
        res = build_report(folder, dest, notes=notes, plots=not no_plots, include_unfinished=include_unfinished,
                           seeds=only)
    except ValueError as e:
        _fail(str(e))
    counts: dict[str, int] = {}
    for v in res["verdicts"]:
        counts[v["verdict"]] = counts.get(v["verdict"], 0) + 1
    typer.echo(f"report: {dest / 'README.md'} ({len(res['verdicts'])} runs: "
               + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + ")")


def register(app: typer.Typer) -> None:
    """Add `experiment` and `report` to the `mixfleet` app."""
    app.add_typer(experiment_app, name="experiment")
    app.add_typer(report_app, name="report")
