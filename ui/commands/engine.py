"""`mixfleet` commands: init-model, mismatch: checkpoints and measured precision mismatch of the embedded engine.

`init-model` writes a seeded random checkpoint (Hugging Face layout + tokenizer) of a model spec;
`mismatch` measures each serving precision's sampler-trainer mismatch against the fp32 reference
(runner/sampler/mismatch.py). Bad input prints one line naming the field and what is allowed (exit 2).
"""

from __future__ import annotations

import json

import typer


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(code=2)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `mixfleet` app."""

    @app.command("init-model")
    def init_model_cmd(
        spec: str = typer.Argument(..., help="Model spec name (tiny, tiny-qwen3, tiny-qwen3-moe) or TOML path."),
        out: str = typer.Option(..., "--out", "-o", help="Checkpoint folder to write (new or empty)."),
        force: bool = typer.Option(False, "--force", help="Replace a checkpoint already in --out (never a folder "
                                                          "mixfleet did not write)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the random init."),
        logit_scale: float = typer.Option(4.0, "--logit-scale", help="Std of the initial logits (peakedness)."),
        weight_version: str = typer.Option("0", "--weight-version", help="Version written into config.json."),
    ) -> None:
        """Write a seeded, randomly initialized checkpoint of a model spec, with its tokenizer."""
        from mixfleet.costmodel.errors import SpecError
        from mixfleet.costmodel.records.outdir import prepare_output_dir
        from mixfleet.costmodel.specs.model import load_model_spec
        from mixfleet.runner.checkpoint.init_model import init_model

        try:
            model_spec = load_model_spec(spec)
            # clear=False: save_checkpoint replaces the old checkpoint by renames (a reader never sees half)
            prepare_output_dir(out, "checkpoint", where="mixfleet init-model", force=force, clear=False)
            path = init_model(model_spec, out, seed=seed, logit_scale=logit_scale,
                              weight_version=weight_version)
        except (SpecError, ValueError, FileNotFoundError, OSError) as e:
            _fail(e)
        typer.echo(f"wrote {path} (model {spec}, seed {seed}, weight_version {weight_version})")

    @app.command("mismatch")
    def mismatch_cmd(
        model: str = typer.Option(..., "--model", "-m", help="Checkpoint folder (Hugging Face layout)."),
        precisions: str = typer.Option("bf16,fp8,nvfp4,mxfp4", "--precisions",
                                       help="Comma-separated: fp32, bf16, fp8, nvfp4, mxfp4."),
        kv: str = typer.Option("fp8_e4m3", "--kv", help="KV-cache dtype: bf16, fp8_e4m3, fp32."),
        kernel: str = typer.Option(None, "--kernel", help="Matmul dtype fp32 | bf16 (default: bf16; fp32 for fp32)."),
        weight_noise: float = typer.Option(0.0, "--weight-noise",
                                           help="The engine's emulated kernel error (relative std; 0 = off)."),
        num_prompts: int = typer.Option(12, "--num-prompts", help="Prompts per precision."),
        max_new_tokens: int = typer.Option(48, "--max-new-tokens", help="Sampled tokens per prompt."),
        temperature: float = typer.Option(1.0, "--temperature", help="Sampling temperature (> 0)."),
        seed: int = typer.Option(0, "--seed", help="Sampling seed."),
        threads: int = typer.Option(1, "--threads", help="torch CPU threads (1 is fastest on a shared CPU)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Per-token KL (k1, k3, exact), ratio-band share and top-1 agreement of each precision vs fp32."""
        import torch
        from mixfleet.runner.sampler.mismatch import MismatchConfig, format_table, measure_mismatch

        if threads < 1:
            _fail(ValueError(f"--threads = {threads}; allowed: an integer >= 1"))
        torch.set_num_threads(threads)
        try:
            cfg = MismatchConfig(precisions=tuple(p.strip() for p in precisions.split(",") if p.strip()),
                                 kv_cache_dtype=kv, kernel=kernel, weight_noise=weight_noise, num_prompts=num_prompts,
                                 max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
            rows = measure_mismatch(model, cfg)
        except (ValueError, FileNotFoundError, OSError) as e:
            _fail(e)
        if as_json:
            typer.echo(json.dumps({"model": model, "reference": "fp32 weights, fp32 KV, fp32 kernel",
                                   "temperature": temperature, "rows": [r.to_dict() for r in rows]}, indent=2))
            return
        typer.echo(f"mismatch vs the fp32 reference, model {model}, T = {temperature}")
        typer.echo(format_table(rows))
