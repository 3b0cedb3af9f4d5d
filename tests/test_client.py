"""runner/sampler/client.py against the embedded server (real engine, real HTTP on loopback).

Covers generate with the routing-key header (a session's second turn reuses its cached prefix),
streaming, load, pause / continue, weight update and version, abort, health; retries with backoff
while a server is still starting; a clear error when nothing ever listens; 400s carry the
server's message.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.client import ClientConfig, Load, SamplerClient, SamplerHTTPError, SamplerUnavailable
from sampler_helpers import make_checkpoint, served_engine

TOK = ByteTokenizer()
PROMPT = TOK.encode("<|user|>hi<|assistant|>")
FAST_RETRY = ClientConfig(max_retries=40, backoff_initial_s=0.02, backoff_max_s=0.2, connect_timeout_s=2.0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    return make_checkpoint(root / "v0", seed=0, weight_version="0"), make_checkpoint(root / "v1", seed=1,
                                                                                      weight_version="7")


@pytest.fixture(scope="module")
def server(checkpoints):
    with served_engine(checkpoints[0]) as (engine, url):
        yield engine, url


def test_generate_stream_and_control(server, checkpoints):
    _engine, url = server

    async def run():
        async with SamplerClient(url) as c:
            await c.wait_healthy(timeout_s=30)
            assert await c.health()
            out = await c.generate_ids(PROMPT, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                                       rid="c1", top_logprobs_num=2, routing_key="sess-A")
            assert out["meta_info"]["id"] == "c1" and len(out["output_ids"]) == 4
            assert len(out["meta_info"]["output_token_logprobs"]) == 4
            assert all(len(t) == 2 for t in out["meta_info"]["output_top_logprobs"])
            turn2 = PROMPT + out["output_ids"] + TOK.encode("<|user|>ok<|assistant|>")
            out2 = await c.generate_ids(turn2, {"max_new_tokens": 2, "ignore_eos": True}, routing_key="sess-A")
            assert out2["meta_info"]["cached_tokens"] > 0         # same session: the prefix was reused
            chunks = [ch async for ch in c.stream({"input_ids": PROMPT, "sampling_params": {
                "max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})]
            assert len(chunks) == 4 and chunks[-1]["output_ids"] == out["output_ids"][:3]
            load = await c.load()
            assert isinstance(load, Load) and load.num_running_reqs == 0 and load.num_waiting_reqs == 0
            assert (await c.pause("in_place"))["status"] == "ok"
            task = asyncio.create_task(c.generate_ids(PROMPT, {"max_new_tokens": 3, "ignore_eos": True}))
            while (await c.load()).num_waiting_reqs + (await c.load()).num_running_reqs == 0:
                await asyncio.sleep(0.01)
            assert not task.done()
            assert (await c.resume())["status"] == "ok"
            assert len((await task)["output_ids"]) == 3
            assert await c.flush_cache()
            res = await c.update_weights_from_disk(str(checkpoints[1]))
            assert res["success"] is True and await c.weight_version() == "7"
            res = await c.update_weights_from_disk(str(checkpoints[1]) + "-nope")
            assert res["success"] is False and await c.weight_version() == "7"
            assert (await c.update_weight_version("8"))["new_version"] == "8"
            assert (await c.model_info())["weight_version"] == "8"
            assert (await c.server_info())["mixfleet"]["engine"] == "embedded"
            res = await c.update_weights_from_disk(str(checkpoints[0]), weight_version="0")
            assert res["success"] is True and await c.weight_version() == "0"
            # abort: the pending generate returns its partial output
            task = asyncio.create_task(c.generate_ids(PROMPT, {"max_new_tokens": 900, "ignore_eos": True},
                                                      rid="long"))
            while (await c.load()).num_running_reqs == 0:
                await asyncio.sleep(0.01)
            await c.abort("long")
            out = await task
            assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) < 900
            with pytest.raises(SamplerHTTPError) as e:
                await c.generate_ids([1, 999], {"max_new_tokens": 1})
            assert e.value.status == 400 and "outside the vocabulary" in e.value.message
            with pytest.raises(SamplerHTTPError, match="top_p = 0"):
                async for _ in c.stream({"input_ids": [1], "sampling_params": {"top_p": 0}}):
                    pass

    asyncio.run(run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_retries_until_the_server_is_up(checkpoints):
    """The client's first connection attempts are refused (no server yet); it backs off and succeeds."""
    from mixfleet.runner.sampler.engine import Engine
    from mixfleet.runner.sampler.server import ServerArgs
    from mixfleet.runner.sampler.server_launch import start_in_thread

    port = _free_port()
    engine = Engine(checkpoints[0], precision="bf16", kv_cache_dtype="bf16", kernel="fp32")
    handles = []
    client_started = threading.Event()

    def start_later():
        client_started.wait(30)
        time.sleep(0.3)                    # the client is retrying by now
        handles.append(start_in_thread(engine, server_args=ServerArgs(port=port)))

    t = threading.Thread(target=start_later)
    t.start()

    async def run():
        async with SamplerClient(f"http://127.0.0.1:{port}", config=FAST_RETRY) as c:
            client_started.set()
            return await c.generate_ids(PROMPT, {"max_new_tokens": 2, "ignore_eos": True})

    try:
        out = asyncio.run(run())
        assert len(out["output_ids"]) == 2
    finally:
        t.join()
        for h in handles:
            h.stop()


def test_unreachable_server_is_a_clear_error():
    port = _free_port()
    cfg = ClientConfig(max_retries=2, backoff_initial_s=0.01, backoff_max_s=0.02, connect_timeout_s=1.0)

    async def run():
        async with SamplerClient(f"http://127.0.0.1:{port}", config=cfg) as c:
            assert not await c.health()
            with pytest.raises(SamplerUnavailable, match="after 3 attempts"):
                await c.generate_ids([1], {"max_new_tokens": 1})
            with pytest.raises(SamplerUnavailable, match="not healthy after"):
                await c.wait_healthy(timeout_s=0.2, poll_s=0.05)

    asyncio.run(run())


def test_load_normalizes_sglang_shapes():
    assert Load.from_json({"num_running_reqs": 2, "num_waiting_reqs": 1, "token_usage": 0.5}) == \
        Load(num_running_reqs=2, num_waiting_reqs=1, token_usage=0.5,
             raw={"num_running_reqs": 2, "num_waiting_reqs": 1, "token_usage": 0.5})
    per_rank = [{"num_reqs": 3, "num_waiting_reqs": 0, "token_usage": 0.1},
                {"num_reqs": 1, "num_waiting_reqs": 4, "token_usage": 0.3}]
    load = Load.from_json(per_rank)
    assert (load.num_running_reqs, load.num_waiting_reqs, load.token_usage) == (4, 4, 0.3)


def test_config_validation():
    with pytest.raises(ValueError, match="ClientConfig.max_retries = -1"):
        ClientConfig(max_retries=-1)
    with pytest.raises(ValueError, match="ClientConfig.request_timeout_s = 0"):
        ClientConfig(request_timeout_s=0)
