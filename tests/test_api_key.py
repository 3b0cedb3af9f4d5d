"""Per-run API key on the embedded sampler, over real HTTP on loopback (SGLang's `--api-key` behaviour):
every endpoint but the health checks answers 401 with a message unless `Authorization: Bearer <key>`
matches; the client sends it; the key never shows in /get_server_info or a printed SGLang command.
"""

from __future__ import annotations

import asyncio
import secrets

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
