"""`mixfleet serve` as a user runs it: a subprocess serving a tiny checkpoint on loopback.

Covers: the command starts, binds 127.0.0.1, serves /generate in the requested precision and KV
dtype, and stops on SIGINT; bad flags give a one-line error naming the allowed values (exit 2,
no traceback); --print-sglang prints the equivalent SGLang command.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import pytest
from mixfleet.runner.sampler.sglang_launch import attach
from mixfleet.ui.cli import app
from sampler_helpers import make_checkpoint
from typer.testing import CliRunner

CLI = [sys.executable, "-m", "mixfleet.ui.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subprocess(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ck", seed=0, weight_version="3")
    port = _free_port()
    proc = subprocess.Popen([*CLI, "serve", "--model", str(ckpt), "--precision", "fp8", "--kv-cache-dtype",
                             "fp8_e4m3", "--port", str(port), "--max-running-requests", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        found = attach(f"http://127.0.0.1:{port}", wait_s=120)
        assert found.weight_version == "3" and found.model_path == str(ckpt)
        info = found.server_info
        assert (info["host"], info["quantization"], info["kv_cache_dtype"], info["max_running_requests"]) == \
            ("127.0.0.1", "fp8", "fp8_e4m3", 8)
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60, trust_env=False,
                       json={"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "Traceback" not in out


@pytest.mark.parametrize("args, message", [
    (["--precision", "int4"], "error: --precision 'int4'; allowed: fp32, bf16, fp8, nvfp4, mxfp4"),
    (["--kv-cache-dtype", "fp16"], "error: --kv-cache-dtype 'fp16'; allowed: bf16, fp8_e4m3, fp32"),
    (["--kernel", "fp16"], "error: --kernel 'fp16'; allowed: fp32, bf16"),
    (["--port", "0"], "error: --port 0; allowed: 1..65535"),
    (["--max-running-requests", "0"], "error: --max-running-requests 0; allowed: an integer >= 1"),
])
def test_serve_bad_flags(tmp_path, args, message):
    r = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), *args])
    assert r.exit_code == 2 and message in r.output and "Traceback" not in r.output


def test_serve_missing_checkpoint_and_print_sglang(tmp_path):
    r = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "nope")])
    assert r.exit_code == 2 and "no config.json there" in r.output
    r = CliRunner().invoke(app, ["serve", "--model", "/ckpt", "--precision", "mxfp4", "--port", "30005",
                                 "--print-sglang"])
    assert r.exit_code == 0
    assert r.output.split() == ["python", "-m", "sglang.launch_server", "--model-path", "/ckpt", "--host", "127.0.0.1",
                                "--port", "30005", "--tp-size", "1", "--quantization", "mxfp4",
                                "--sampling-mask-max-tokens", "512"]


def test_serve_routed_experts_flag(tmp_path):
    """--enable-return-routed-experts: refused on a dense checkpoint with one line; passed on to real SGLang."""
    from mixfleet.costmodel.specs.model import load_model_spec
    from mixfleet.runner.checkpoint.init_model import init_model

    dense = init_model(load_model_spec("tiny"), tmp_path / "tiny")
    r = CliRunner().invoke(app, ["serve", "--model", str(dense), "--enable-return-routed-experts"])
    assert r.exit_code == 2 and "has no experts" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["serve", "--model", "/ckpt", "--port", "30005", "--print-sglang",
                                 "--enable-return-routed-experts"])
    assert r.exit_code == 0 and r.output.split()[-1] == "--enable-return-routed-experts"
