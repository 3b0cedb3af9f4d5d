"""`mixfleet evaluate PATH`: a run's last policy (or a checkpoint) on a held-out split, as many problems as asked.

The library is `mixfleet.runner.orchestration.evaluate_run` (module doc: settings, common random numbers). Bad input
(not a run folder nor a checkpoint, a run without a checkpoint, an out-of-range problem count, an `--out` that exists
without `--force` or lies inside a run folder) prints one line and exits with 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register_evaluate(app: typer.Typer) -> None:
    """Add `evaluate` to the `mixfleet` app."""

    @app.command("evaluate")
    def evaluate_cmd(
        path: Path = typer.Argument(..., help="A run folder (mixfleet run --out: its last checkpoint) or a Hugging "
                                    "Face layout checkpoint (e.g. a `mixfleet pretrain` base)."),
        problems: int = typer.Option(256, "--problems", help="Held-out problems (the split's first N seeds)."),
        k: int = typer.Option(2, "--k", help="Samples per problem (pass@k counts a problem solved by any)."),
        seed: int = typer.Option(0, "--seed", help="Sampling seed: the same seed gives two policies the same "
                                 "random draws (a paired comparison)."),
        temperature: float = typer.Option(None, "--temperature", help="Default: the run's own evaluation's (1)."),
        top_p: float = typer.Option(None, "--top-p", help="Default: the run's own evaluation's (1: full vocabulary)."),
        max_turns: int = typer.Option(None, "--max-turns", help="Default: the run's own evaluation's."),
        max_new_tokens: int = typer.Option(None, "--max-new-tokens", help="Default: the run's own evaluation's."),
        split: str = typer.Option("eval", "--split", help="Which held-out problems: eval (the run's own periodic "
                                  "evaluation's) or general (problems unlike any in training: guess's targets "
                                  "51..100, calc's larger operands; runner/rollout/tasks/base.py)."),
        task_set: Path = typer.Option(None, "--task-set", help="Evaluate on this task set (a folder of repository "
                                      "tasks, docs/tasks.md) with the repo task; prints the outcome per task. "
                                      "Default: the run's own task."),
        out: Path = typer.Option(None, "--out", "-o", help="Also write the result (with each problem's reward) "
                                 "to this JSON file (a new file outside every run folder)."),
        force: bool = typer.Option(False, "--force", help="Replace the file --out names if it exists."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    ) -> None:
        """Evaluate a run's last policy (its trainer_state, exported as the samplers load it) with the run's own
        evaluation settings, on more problems than the run's periodic evaluation: mean reward with its standard
        error, pass@k. With the run's problem count, k and seed it reproduces the run's last evaluation."""
        from mixfleet.costmodel.errors import SpecError
        from mixfleet.costmodel.jsonsafe import json_safe
        from mixfleet.costmodel.records.outdir import prepare_output_file
        from mixfleet.runner.orchestration.evaluate_run import evaluate_policy

        try:
            if out is not None:                 # checked before anything is built: never replaced, never in a run
                prepare_output_file(out, where="mixfleet evaluate", force=force)
            on_set = {} if task_set is None else {"task": "repo", "task_options": {"task_set": str(task_set)}}
            res = evaluate_policy(path, problems=problems, k=k, seed=seed, temperature=temperature, top_p=top_p,
                                  max_turns=max_turns, max_new_tokens=max_new_tokens, split=split, **on_set)
        except (SpecError, ValueError, FileNotFoundError) as e:
            typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None
        doc = json_safe(res.to_dict())
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = out.with_name(f".{out.name}.tmp")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            tmp.replace(out)
        if as_json:
            typer.echo(json.dumps(doc, indent=1))
            return
        s = res.settings
        typer.echo(f"{path} ({res.kind}, version {res.version}): held-out reward {res.reward:.3f} "
                   f"+- {res.reward_se:.3f} (standard error), pass@{s['k']} {res.pass_at_k:.3f}; {s['problems']} "
                   f"problems x {s['k']} ({s['split']} split), T = {s['temperature']}, top-p {s['top_p']}, "
                   f"seed {s['seed']}, {res.wall_s:.0f} s")
        if (s.get("task_options") or {}).get("task_set"):     # a task set's tasks by name (docs/tasks.md)
            rows = res.by_task()
            width = max(len(r["task"]) for r in rows)
            typer.echo(f"per task ({s['task_options']['task_set']}):")
            for r in rows:
                typer.echo(f"  {r['task']:<{width}}  reward {r['reward']:.3f}  solved {r['solved']} of "
                           f"{r['problems']} problems (pass@{s['k']})")
