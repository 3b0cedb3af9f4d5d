"""`mixfleet pretrain`: train (or reuse) the base policy and report its reward.

The base policy is the tiny model imitating slightly noisy scripted demonstrations of a task
(runner/orchestration/pretrain.py); it is cached by a hash of its inputs, so a second call returns at once. After
training, the command samples episodes of the held-out split with the embedded engine and prints
the policy's mean reward, the number RL starts from.
"""

from __future__ import annotations

import json

import typer


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(code=2)


def register_pretrain(app: typer.Typer) -> None:
    """Add `pretrain` to the app."""

    @app.command("pretrain")
    def pretrain_cmd(
        model: str = typer.Option("tiny", "--model", "-m", help="Model spec name (data/models) or TOML path."),
        task: str = typer.Option("guess", "--task", "-t", help="Task to imitate: guess | calc | repo."),
        steps: int = typer.Option(None, "--steps", help="Optimizer steps (default: the recipe's, 150)."),
        out: str = typer.Option(None, "--out", "-o", help="Also copy the checkpoint folder here (new or empty)."),
        force: bool = typer.Option(False, "--force", help="Retrain even if the cache has this base policy (and "
                                                          "replace a checkpoint already in --out)."),
        demos: int = typer.Option(None, "--demos", help="Demonstration episodes (default 2000)."),
        noise: float = typer.Option(None, "--noise", help="Share of noisy demonstrator replies, 0..1 (default 0.25)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the demonstrations, the init and the row order."),
        lr_decay: bool = typer.Option(False, "--lr-decay", help="Cosine learning rate from its peak to 0 over the "
                                      "steps (default: constant after warmup)."),
        init_from: str = typer.Option(None, "--init-from", help="Go on training this base (its folder, or its "
                                      "cache key) instead of a fresh init: e.g. more steps with --lr-decay."),
        cache_dir: str = typer.Option(None, "--cache-dir", help="Cache root (default ~/.cache/mixfleet/base)."),
        eval_episodes: int = typer.Option(64, "--eval-episodes", help="Held-out episodes sampled to measure the "
                                          "reward (0: skip)."),
        precision: str = typer.Option("bf16", "--precision", help="Engine precision for the reward: fp32 | bf16."),
        threads: int = typer.Option(2, "--threads", help="torch CPU threads."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    ) -> None:
        """Train the base policy on synthetic demonstrations (cached) and print its measured reward."""
        import dataclasses
        import warnings

        import torch
        from mixfleet.costmodel.errors import SpecError
        from mixfleet.costmodel.records.outdir import prepare_output_dir
        from mixfleet.costmodel.specs.formats import formats
        from mixfleet.runner.orchestration.pretrain import PretrainConfig, base_folder, measure_reward, pretrain
        from mixfleet.runner.rollout.demos import DemoConfig
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        if threads < 1:
            _fail(ValueError(f"--threads: {threads} must be an integer >= 1"))
        unquantized = formats().kernels      # the formats the engine also computes in (data/precisions.toml)
        if precision not in unquantized:
            _fail(ValueError(f"--precision: {precision!r}; allowed: {', '.join(unquantized)}"))
        if eval_episodes < 0:
            _fail(ValueError(f"--eval-episodes: {eval_episodes} must be >= 0"))
        torch.set_num_threads(threads)
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
        try:
            demo_kw = {"task": task, "seed": seed}
            if demos is not None:
                demo_kw["num_episodes"] = demos
            if noise is not None:
                demo_kw["noise"] = noise
            kw: dict = {"model": model, "demos": DemoConfig(**demo_kw), "seed": seed, "lr_decay": lr_decay}
            if init_from is not None:
                kw["init_from"] = base_folder(init_from, cache_dir)
            if steps is not None:
                kw["steps"] = steps
            cfg = PretrainConfig(**kw)
            cfg.spec()
            if out is not None:  # the copy overwrites the checkpoint's own file names, after training
                prepare_output_dir(out, "checkpoint", where="mixfleet pretrain", force=force, clear=False)
        except (SpecError, ValueError, FileNotFoundError) as e:
            _fail(e)
        columns = (TextColumn("pretrain {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), TimeRemainingColumn())
        # on stderr: stdout stays the result (JSON with --json); demonstrations first (a repo one takes ~1 s)
        with Progress(*columns, transient=as_json, console=Console(stderr=True)) as bar:
            did = bar.add_task(f"{cfg.demos.task} demonstrations", total=cfg.demos.num_episodes, loss="-")
            tid = bar.add_task(f"{cfg.demos.task} on {model} (steps)", total=cfg.steps, loss="-")

            plain = not bar.console.is_terminal      # a log file: a plain line every 5 % instead of the bar

            def say(done: int, total: int, what: str) -> None:
                if plain and (done % max(1, total // 20) == 0 or done == total):
                    typer.echo(f"pretrain: {what}", err=True)

            def progress(step: int, total: int, m: dict) -> None:
                bar.update(tid, completed=step, loss=f"{m['loss']:.3f}")
                say(step, total, f"step {step}/{total}, loss {m['loss']:.3f}, token accuracy "
                                 f"{m['token_accuracy']:.3f}")

            def demo_progress(done: int, total: int) -> None:
                bar.update(did, completed=done)
                say(done, total, f"demonstrations {done}/{total}")

            try:
                result = pretrain(cfg, cache_dir=cache_dir, force=force, out=out, progress=progress,
                                  demo_progress=demo_progress)
            except (SpecError, ValueError, OSError) as e:
                _fail(e)
            if result.reused:
                bar.update(did, completed=cfg.demos.num_episodes)
                bar.update(tid, completed=cfg.steps, loss=f"{result.meta['losses'][-1]:.3f}")
        report = None
        if eval_episodes:
            if not as_json:
                typer.echo(f"sampling {eval_episodes} held-out {task} episodes with the embedded engine "
                           f"({precision})...")
            report = measure_reward(result.path, task=task, episodes=eval_episodes, precision=precision, seed=seed)
        meta = result.meta
        if as_json:
            typer.echo(json.dumps({"path": str(result.path), "key": result.key, "reused": result.reused,
                                   "final_loss": meta["losses"][-1], "train_s": meta["train_s"],
                                   "demo_reward": meta["demo_stats"]["reward"],
                                   "eval": dataclasses.asdict(report) if report else None}, indent=2))
            return
        state = "reused from the cache" if result.reused else f"trained in {meta['train_s']:.0f} s"
        typer.echo(f"base policy: {result.path} ({state}; key {result.key})")
        typer.echo(f"loss {meta['losses'][0]:.3f} -> {meta['losses'][-1]:.3f}; demonstrations' reward "
                   f"{meta['demo_stats']['reward']:.3f}")
        if report is not None:
            shares = ", ".join(f"{k} {v:.0%}" for k, v in sorted(report.finish_reasons.items()))
            typer.echo(f"reward on {report.episodes} held-out {task} episodes ({precision}, T=1): "
                       f"{report.reward:.3f} (finish: {shares}; {report.mean_turns:.1f} turns, "
                       f"{report.wall_s:.0f} s)")
