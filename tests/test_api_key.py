"""Per-run API key on the embedded sampler, over real HTTP on loopback (SGLang's `--api-key` behaviour):
every endpoint but the health checks answers 401 with a message unless `Authorization: Bearer <key>`
matches; the client sends it; the key never shows in /get_server_info or a printed SGLang command, and a
launched SGLang server gets it outside its command line (a private YAML `--config` file; issue 24: it was in argv,
visible in `ps`).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.client import SamplerClient, SamplerHTTPError
from mixfleet.runner.sampler.server import ServerArgs
from mixfleet.runner.sampler.sglang_launch import SGLangLaunchSpec, describe, launch_argv
from sampler_helpers import make_checkpoint, served_engine

KEY = secrets.token_urlsafe(32)
PROMPT = ByteTokenizer().encode("<|user|>hi<|assistant|>")
BODY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("key") / "v0", seed=0, weight_version="0")
    with served_engine(ckpt, api_key=KEY) as (engine, url):
        yield url


def test_without_key_401_with_message(server):
    with httpx.Client(base_url=server, timeout=60, trust_env=False) as http:
        for method, path, body in (("POST", "/generate", BODY), ("GET", "/get_server_info", None),
                                   ("POST", "/update_weights_from_disk", {"model_path": "/tmp"}),
                                   ("GET", "/get_model_info", None), ("POST", "/flush_cache", None)):
            r = http.request(method, path, json=body)
            assert r.status_code == 401, (path, r.status_code, r.text)
            assert "Authorization: Bearer" in r.json()["error"]["message"]
        wrong = http.post("/generate", json=BODY, headers={"Authorization": "Bearer " + "x" * 43})
        assert wrong.status_code == 401 and "wrong API key" in wrong.json()["error"]["message"]
        assert http.post("/generate", json=BODY, headers={"Authorization": KEY}).status_code == 401  # no "Bearer"
        assert http.get("/health").status_code == 200          # as SGLang: health checks need no key


def test_with_key_200(server):
    with httpx.Client(base_url=server, timeout=60, trust_env=False,
                      headers={"Authorization": f"Bearer {KEY}"}) as http:
        r = http.post("/generate", json=BODY)
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) >= 1
        info = http.get("/get_server_info").json()
        assert KEY not in r.text and KEY not in str(info)
        assert info["mixfleet"]["api_key_required"] is True


def test_client_sends_key(server):
    async def go():
        async with SamplerClient(server, api_key=KEY) as c:
            out = await c.generate(BODY)
            assert out["meta_info"]["completion_tokens"] >= 1
        async with SamplerClient(server) as c:
            with pytest.raises(SamplerHTTPError) as e:
                await c.generate(BODY)
            assert e.value.status == 401

    asyncio.run(go())


def test_key_settings_checked_and_masked():
    with pytest.raises(ValueError, match="api_key"):
        ServerArgs(api_key="short")
    assert KEY not in repr(ServerArgs(api_key=KEY))
    spec = SGLangLaunchSpec(model_path="/m", port=30000, api_key=KEY)
    argv = launch_argv(spec)
    assert argv[argv.index("--api-key") + 1] == KEY          # real SGLang gets the key itself
    assert KEY not in describe(argv) and KEY not in repr(spec)


def test_serve_host_binds_the_node_address_only_off_the_driver_node():
    from mixfleet.runner.orchestration.actors import serve_host

    assert serve_host("node-a", "node-a", "10.0.0.5") == "127.0.0.1"     # the driver's node: loopback
    assert serve_host("node-b", "node-a", "10.0.0.6") == "10.0.0.6"      # another node: its own address
    assert serve_host(None, "node-a", "10.0.0.6") == "127.0.0.1"         # outside Ray (in-process)
    assert serve_host("node-b", None, "10.0.0.6") == "127.0.0.1"


# ---- the API key of a launched SGLang server stays off its command line --------------------------------------
FAKE_SGLANG = textwrap.dedent('''
    """A stand-in for `python -m sglang.launch_server` that reads `--config FILE.yaml` as SGLang's
    ConfigArgumentMerger does (keys are flag names, '-' or '_'), and serves the embedded engine with that key."""
    import argparse, sys
    import yaml
    from mixfleet.runner.sampler.engine import Engine
    from mixfleet.runner.sampler.server import ServerArgs
    from mixfleet.runner.sampler.server_launch import serve

    p = argparse.ArgumentParser()
    for flag in ("--model-path", "--host", "--config", "--api-key"):
        p.add_argument(flag)
    p.add_argument("--port", type=int)
    p.add_argument("--tp-size", type=int)
    a, _ = p.parse_known_args()
    cfg = {k.replace("-", "_"): v for k, v in (yaml.safe_load(open(a.config)) if a.config else {}).items()}
    key = a.api_key or cfg.get("api_key")
    serve(Engine(a.model_path, precision="bf16", kv_cache_dtype="bf16", kernel="fp32"),
          server_args=ServerArgs(host=a.host, port=a.port, api_key=key))
''')


def test_launched_sglang_gets_its_key_outside_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mixfleet.runner.sampler.sglang_launch import SGLangLaunchSpec, launch, launch_argv

    key = "k" * 20 + "-secret-of-this-run"
    spec = SGLangLaunchSpec(model_path="/m", port=30001, api_key=key)
    argv = launch_argv(spec, api_key_file="/run/k.yaml")
    assert key not in " ".join(argv) and "--api-key" not in argv
    assert argv[-2:] == ["--config", "/run/k.yaml"]

    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_SGLANG)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    ckpt = make_checkpoint(tmp_path / "ck", seed=0, weight_version="0")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "fake"), *sys.path])}
    proc, found = launch(SGLangLaunchSpec(model_path=str(ckpt), port=port, api_key=key), env=env, wait_s=180)
    try:
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode()
        assert key not in cmdline and "--config" in cmdline                    # what `ps` shows
        config_file = cmdline.split("\0")[cmdline.split("\0").index("--config") + 1]
        assert not Path(config_file).exists()                                  # read at start, then removed
        assert found.model_path == str(ckpt)                                   # attach() sent the key: it read info
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(base + "/get_model_info", trust_env=False, timeout=30).status_code == 401
        assert httpx.get(base + "/get_model_info", headers={"Authorization": f"Bearer {key}"},
                         trust_env=False, timeout=30).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_key_file_is_private_and_valid_yaml(tmp_path: Path) -> None:
    import stat

    import yaml
    from mixfleet.runner.sampler.sglang_launch import write_api_key_config

    key = "abc_DEF-123" * 3
    path = write_api_key_config(key, directory=tmp_path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.suffix == ".yaml"
        assert yaml.safe_load(path.read_text()) == {"api-key": key}
    finally:
        path.unlink()
