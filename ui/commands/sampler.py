"""`mixfleet serve`: the embedded sampler behind SGLang's HTTP protocol, in one precision.

    mixfleet serve --model CKPT --precision nvfp4 --kv-cache-dtype fp8_e4m3 --port 30000

Loads a Hugging Face layout checkpoint (e.g. from `mixfleet init-model tiny -o CKPT`), quantizes
it to the precision, and serves /generate and SGLang's control endpoints on 127.0.0.1 unless
--host says otherwise. `--print-sglang` prints the equivalent real-SGLang command instead.
"""

from __future__ import annotations

from pathlib import Path

import typer


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def serve(
    model: Path = typer.Option(..., "--model", help="checkpoint folder (config.json + model.safetensors)"),
    precision: str = typer.Option("bf16", help="weight precision: fp32, bf16, fp8, nvfp4, mxfp4"),
    kv_cache_dtype: str = typer.Option("bf16", "--kv-cache-dtype", help="KV cache dtype: bf16, fp8_e4m3, fp32"),
    host: str = typer.Option("127.0.0.1", help="bind address (loopback by default)"),
    port: int = typer.Option(30000, help="TCP port"),
    kernel: str | None = typer.Option(None, help="matmul dtype after dequantization: fp32 or bf16 "
                                                  "(default: fp32 for fp32 weights, else bf16)"),
    max_running_requests: int = typer.Option(64, "--max-running-requests", help="batch size limit"),
    max_total_tokens: int = typer.Option(65536, "--max-total-tokens", help="KV-token budget"),
    sampling_mask_max_tokens: int = typer.Option(512, "--sampling-mask-max-tokens",
                                                 help="largest top-p kept set returned per token"),
    max_body_bytes: int = typer.Option(8 * 1024 * 1024, "--max-body-bytes", help="request body limit"),
    weight_version: str | None = typer.Option(None, "--weight-version",
                                              help="version to report (default: the checkpoint's)"),
    seed: int = typer.Option(0, help="seed of requests that bring no sampling_seed"),
    enable_return_routed_experts: bool = typer.Option(
        False, "--enable-return-routed-experts",
        help="MoE models: record each token's experts so requests may ask for them (return_routed_experts)"),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn log level"),
    header_timeout: float = typer.Option(10.0, "--header-timeout",
                                         help="seconds a connection has to send a request's headers (slow-loris)"),
    limit_concurrency: int = typer.Option(4096, "--limit-concurrency",
                                          help="open connections + requests above this get 503"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="MIXFLEET_API_KEY", show_default=False,
                                       help="require 'Authorization: Bearer KEY' on every request but /health* "
                                            "(as SGLang's --api-key; the environment variable keeps it out of ps)"),
    print_sglang: bool = typer.Option(False, "--print-sglang",
                                      help="print the equivalent `python -m sglang.launch_server` command and exit"),
) -> None:
    """Serve a checkpoint with the embedded engine over SGLang's native HTTP API."""
    from mixfleet.runner.sampler.engine_api import KERNELS, KV_CACHE_DTYPES, PRECISIONS

    if precision not in PRECISIONS:
        _fail(f"--precision {precision!r}; allowed: {', '.join(PRECISIONS)}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        _fail(f"--kv-cache-dtype {kv_cache_dtype!r}; allowed: {', '.join(KV_CACHE_DTYPES)}")
    if kernel is not None and kernel not in KERNELS:
        _fail(f"--kernel {kernel!r}; allowed: {', '.join(KERNELS)}")
    if not 1 <= port <= 65535:
        _fail(f"--port {port}; allowed: 1..65535")
    for name, v in (("--max-running-requests", max_running_requests), ("--max-total-tokens", max_total_tokens),
                    ("--sampling-mask-max-tokens", sampling_mask_max_tokens), ("--max-body-bytes", max_body_bytes)):
        if v < 1:
            _fail(f"{name} {v}; allowed: an integer >= 1")
    if print_sglang:
        from mixfleet.runner.sampler.sglang_launch import SGLangLaunchSpec, describe, launch_argv

        try:
            spec = SGLangLaunchSpec(model_path=str(model), port=port, host=host, precision=precision,
                                    kv_cache_dtype=kv_cache_dtype, sampling_mask_max_tokens=sampling_mask_max_tokens,
                                    weight_version=weight_version,
                                    enable_return_routed_experts=enable_return_routed_experts,
                                    api_key=api_key)
        except ValueError as e:
            _fail(str(e))
        typer.echo(describe(launch_argv(spec)))
        return
    if not (model / "config.json").exists():
        _fail(f"--model {model}: no config.json there (make one with `mixfleet init-model tiny -o {model}`)")

    from mixfleet.runner.sampler.engine import Engine
    from mixfleet.runner.sampler.server import ServerArgs
    from mixfleet.runner.sampler.server_launch import serve as run_server

    try:
        args = ServerArgs(host=host, port=port, max_body_bytes=max_body_bytes,
                          sampling_mask_max_tokens=sampling_mask_max_tokens,
                          max_running_requests=max_running_requests, kernel=kernel, log_level=log_level,
                          api_key=api_key, header_timeout_s=header_timeout, limit_concurrency=limit_concurrency)
        engine = Engine(model, precision=precision, kv_cache_dtype=kv_cache_dtype, kernel=kernel,
                        max_total_tokens=max_total_tokens, max_running_requests=max_running_requests,
                        sampling_mask_max_tokens=sampling_mask_max_tokens, seed=seed, weight_version=weight_version,
                        enable_return_routed_experts=enable_return_routed_experts)
    except (ValueError, FileNotFoundError, OSError) as e:
        _fail(str(e))
    typer.echo(f"mixfleet serve: {model} ({precision}, KV {kv_cache_dtype}, weight version {engine.weight_version}) "
               f"on http://{host}:{port}" + (" (API key required)" if api_key else ""), err=True)
    run_server(engine, server_args=args)


def register(app: typer.Typer) -> None:
    """Add this module's commands to the `mixfleet` app."""
    app.command("serve")(serve)
