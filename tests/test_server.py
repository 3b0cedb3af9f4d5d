"""The embedded sampler server over real HTTP on loopback, with the real engine on a tiny checkpoint.

Covers PROTOCOL.md's shapes exactly (output_ids include the stop token, one log-prob triple per
output token, top-K lists of length K, mask log-probs normalized over the mask, weight versions),
batch requests, streaming, abort with partial output, pause / continue, an in-flight weight update
with per-token versions, the control endpoints, and bad input -> 400 while other requests keep
being served.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from sampler_helpers import logsumexp, make_checkpoint, served_engine, sse_chunks

TOK = ByteTokenizer()
PROMPT = TOK.encode("<|user|>hello<|assistant|>")
WAIT_S = 60.0                 # upper bound on any wait for the server (never reached when it works)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampler")
    return make_checkpoint(root / "v0", seed=0, weight_version="0"), make_checkpoint(root / "v1", seed=1,
                                                                                      weight_version="1")


@pytest.fixture(scope="module")
def server(checkpoints):
    with served_engine(checkpoints[0], max_body_bytes=64 * 1024) as (engine, url):
        yield engine, url


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server[1], timeout=WAIT_S, trust_env=False) as c:
        yield c


def generate(http, body, status=200):
    r = http.post("/generate", json=body)
    assert r.status_code == status, r.text
    return r.json()


async def wait_for(predicate, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not await predicate():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_response_shapes_exactly(http):
    k = 5
    out = generate(http, {"input_ids": PROMPT, "rid": "shape-1", "return_logprob": True, "top_logprobs_num": k,
                          "return_sampling_mask": True, "sampling_logprobs_mode": "support",
                          "sampling_params": {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "top_k": 20,
                                              "sampling_seed": 3, "ignore_eos": True}})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert set(meta) == {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                         "weight_version", "e2e_latency", "output_token_logprobs", "output_top_logprobs",
                         "output_token_sampling_mask", "output_token_sampling_logprobs",
                         "output_token_weight_versions", "input_token_logprobs", "input_top_logprobs"}
    assert meta["input_token_logprobs"] == meta["input_top_logprobs"] == []    # logprob_start_len -1 (as SGLang)
    ids = out["output_ids"]
    assert meta["id"] == "shape-1"
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"], len(ids)) == (len(PROMPT), 12, 12)
    assert meta["weight_version"] == "0" and meta["output_token_weight_versions"] == ["0"] * 12
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] > 0
    assert out["text"] == TOK.decode(ids, skip_special_tokens=True)
    assert len(meta["output_token_logprobs"]) == len(ids)
    for tid, triple, top, mask, mask_lps in zip(ids, meta["output_token_logprobs"], meta["output_top_logprobs"],
                                               meta["output_token_sampling_mask"],
                                               meta["output_token_sampling_logprobs"], strict=True):
        lp, tid2, text = triple
        assert isinstance(lp, float) and lp <= 0 and tid2 == tid and text is None
        assert len(top) == k
        assert all(len(t) == 3 and t[2] is None for t in top)
        top_lps = [t[0] for t in top]
        assert top_lps == sorted(top_lps, reverse=True) and lp <= top_lps[0]
        assert tid in mask and len(set(mask)) == len(mask) <= 20 and len(mask_lps) == len(mask)
        assert abs(logsumexp(mask_lps)) < 1e-4                            # normalized over the kept set
        # renormalized = full-vocabulary log-prob minus the log of the kept set's mass
        full = {t[1]: t[0] for t in top}
        if all(m in full for m in mask):
            mass = logsumexp([full[m] for m in mask])
            assert mask_lps[mask.index(tid)] == pytest.approx(lp - mass, abs=1e-4)
    # "selected" mode: one renormalized log-prob per token, the sampled token's
    sel = generate(http, {"input_ids": PROMPT, "return_sampling_mask": True,
                          "sampling_params": {"max_new_tokens": 12, "temperature": 0.8, "top_p": 0.9, "top_k": 20,
                                              "sampling_seed": 3, "ignore_eos": True}})
    assert sel["output_ids"] == ids                                      # same seed, same samples
    sel_lps = sel["meta_info"]["output_token_sampling_logprobs"]
    assert all(isinstance(x, float) for x in sel_lps)
    assert sel_lps == pytest.approx([lps[m.index(t)] for t, m, lps in zip(
        ids, meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"], strict=True)], abs=1e-5)
    assert "output_token_logprobs" not in sel["meta_info"] and "output_top_logprobs" not in sel["meta_info"]


def test_stop_token_is_in_output_ids_and_trimmed_from_text(http):
    base = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    free = generate(http, base)["output_ids"]
    # stop on a token that first appears at position i >= 1
    i = next(j for j in range(1, len(free)) if free[j] not in free[:j])
    stop_id = free[i]
    out = generate(http, {**base, "return_logprob": True,
                          "sampling_params": {**base["sampling_params"], "stop_token_ids": [stop_id],
                                              "skip_special_tokens": False}})
    assert out["output_ids"] == free[: i + 1] and out["output_ids"][-1] == stop_id
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert len(out["meta_info"]["output_token_logprobs"]) == i + 1 == out["meta_info"]["completion_tokens"]
    assert out["text"] == TOK.decode(free[:i])
    kept = generate(http, {**base, "sampling_params": {**base["sampling_params"], "stop_token_ids": [stop_id],
                                                       "no_stop_trim": True, "skip_special_tokens": False}})
    assert kept["output_ids"] == out["output_ids"] and kept["text"] == TOK.decode(free[: i + 1])


def test_batch_requests(http):
    prompts = [PROMPT, PROMPT[:3], TOK.encode("abc")]
    outs = generate(http, {"input_ids": prompts, "rid": "b", "return_logprob": True,
                           "sampling_params": [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
                                               for n in (3, 4, 5)]})
    assert isinstance(outs, list) and len(outs) == 3
    for j, out in enumerate(outs):
        meta = out["meta_info"]
        assert meta["id"] == f"b_{j}" and meta["prompt_tokens"] == len(prompts[j])
        assert len(out["output_ids"]) == len(meta["output_token_logprobs"]) == 3 + j
    texts = generate(http, {"text": ["hi", "there"], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert [o["meta_info"]["prompt_tokens"] for o in texts] == [2, 5]
    copies = generate(http, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "n": 3, "temperature": 0,
                                                                      "ignore_eos": True}})
    assert len(copies) == 3 and copies[0]["output_ids"] == copies[1]["output_ids"] == copies[2]["output_ids"]


def test_streaming(http):
    body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    r = http.post("/generate", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks, done = sse_chunks(r)
    assert done and len(chunks) == 7              # one chunk per token, then the finished response
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    for n, c in enumerate(chunks[:-1], start=1):
        assert c["meta_info"]["finish_reason"] is None
        assert c["output_ids"] == final["output_ids"][:n]
        assert len(c["meta_info"]["output_token_logprobs"]) == n
    plain = generate(http, {**body, "stream": False})
    assert plain["output_ids"] == final["output_ids"]
    # a batch streams interleaved chunks tagged with their index; stream_interval thins them
    r = http.post("/generate", json={"input_ids": [PROMPT, PROMPT[:2]], "stream": True,
                                     "sampling_params": {"max_new_tokens": 4, "ignore_eos": True,
                                                         "stream_interval": 2}})
    chunks, done = sse_chunks(r)
    assert done and sorted(c["index"] for c in chunks) == [0, 0, 0, 1, 1, 1]
    finals = [c for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert sorted(c["index"] for c in finals) == [0, 1] and all(len(c["output_ids"]) == 4 for c in finals)


def test_abort_returns_partial_output(server):
    _engine, url = server

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S, trust_env=False) as c:
            body = {"input_ids": PROMPT, "rid": "to-abort", "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
            # streaming: abort after three tokens arrived
            chunks, aborted = [], False
            async with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    chunks.append(line)
                    if not aborted and sum(1 for x in chunks if x.startswith("data: {")) == 3:
                        a = await c.post("/abort_request", json={"rid": "to-abort"})
                        assert a.status_code == 200 and a.json()["num_aborted"] == 1
                        aborted = True
            parsed, done = sse_chunks(chunks)
            final = parsed[-1]
            assert done and final["meta_info"]["finish_reason"]["type"] == "abort"
            assert 3 <= final["meta_info"]["completion_tokens"] < 900
            assert len(final["meta_info"]["output_token_logprobs"]) == len(final["output_ids"])
            # non-streaming: the pending POST answers 200 with the partial tokens
            task = asyncio.create_task(c.post("/generate", json={**body, "rid": "to-abort-2"}))

            async def running():
                return (await c.get("/get_load")).json()["num_running_reqs"] >= 1

            await wait_for(running, "the request to run")
            a = await c.post("/abort_request", json={"abort_all": True})
            assert a.status_code == 200
            r = await task
            assert r.status_code == 200
            out = r.json()
            assert out["meta_info"]["id"] == "to-abort-2" and out["meta_info"]["finish_reason"]["type"] == "abort"
            assert len(out["output_ids"]) == len(out["meta_info"]["output_token_logprobs"]) < 900

    asyncio.run(run())


def test_pause_and_continue(server):
    _engine, url = server

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S, trust_env=False) as c:
            r = await c.post("/pause_generation", json={"mode": "in_place"})
            assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
            task = asyncio.create_task(c.post("/generate", json={
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}))

            async def queued():
                load = (await c.get("/get_load")).json()
                return load["num_waiting_reqs"] + load["num_running_reqs"] == 1

            await wait_for(queued, "the request to queue")
            assert not task.done()
            assert (await c.post("/flush_cache")).status_code == 400          # a request is waiting
            assert (await c.get("/health_generate")).status_code == 200       # paused is alive
            r = await c.post("/continue_generation", json={})
            assert r.json() == {"message": "Generation continued successfully.", "status": "ok"}
            out = (await task).json()
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
            # pause in abort mode ends running requests with their partial output
            task = asyncio.create_task(c.post("/generate", json={
                "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}))

            async def running():
                return (await c.get("/get_load")).json()["num_running_reqs"] == 1

            await wait_for(running, "the request to run")
            await c.post("/pause_generation", json={"mode": "abort"})
            out = (await task).json()
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            await c.post("/continue_generation", json={})
            assert (await c.post("/flush_cache")).status_code == 200

    asyncio.run(run())


def test_weight_update_mid_generation(server, checkpoints):
    _engine, url = server
    v0, v1 = checkpoints

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S, trust_env=False) as c:
            body = {"input_ids": PROMPT, "rid": "upd", "stream": True, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
            lines, updated, final = [], False, None
            async with c.stream("POST", "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    lines.append(line)
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    versions = chunk["meta_info"]["output_token_weight_versions"]
                    if len(versions) == 3 and not updated:
                        u = await c.post("/update_weights_from_disk", json={"model_path": str(v1),
                                                                            "weight_version": "1"})
                        assert u.status_code == 200
                        assert u.json()["success"] is True and u.json()["num_paused_requests"] == 0
                        updated = True
                    if versions[-1] == "1" and chunk["meta_info"]["finish_reason"] is None:
                        await c.post("/abort_request", json={"rid": "upd"})
                    final = chunk
            versions = final["meta_info"]["output_token_weight_versions"]
            n0 = versions.count("0")
            assert n0 >= 3 and versions == ["0"] * n0 + ["1"] * (len(versions) - n0) and versions[-1] == "1"
            assert final["meta_info"]["weight_version"] == "1"
            assert len(versions) == len(final["output_ids"]) == len(final["meta_info"]["output_token_logprobs"])
            assert (await c.get("/weight_version")).json() == {"weight_version": "1"}
            assert (await c.get("/get_model_info")).json()["model_path"] == str(v1)
            # a failed load keeps the old weights serving
            bad = await c.post("/update_weights_from_disk", json={"model_path": str(v1) + "-missing"})
            assert bad.status_code == 400 and bad.json()["success"] is False and "missing" in bad.json()["message"]
            assert (await c.get("/get_weight_version")).json() == {"weight_version": "1"}
            # rename the version, then go back to v0 for the other tests
            r = await c.post("/update_weight_version", json={"new_version": "1b"})
            assert r.json()["success"] is True and (await c.get("/weight_version")).json()["weight_version"] == "1b"
            r = await c.post("/update_weights_from_disk", json={"model_path": str(v0)})
            assert r.json()["success"] is True
            assert (await c.get("/weight_version")).json()["weight_version"] == "0"   # the checkpoint's own

    asyncio.run(run())


def test_info_and_control_endpoints(http, checkpoints):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = http.get(path).json()
        assert info["model_path"] == str(checkpoints[0]) and info["is_generation"] is True
        assert info["weight_version"] == "0"
    for path in ("/server_info", "/get_server_info"):
        info = http.get(path).json()
        assert (info["host"], info["tp_size"], info["quantization"], info["kv_cache_dtype"]) == \
            ("127.0.0.1", 1, None, "auto")
        assert info["mixfleet"]["precision"] == "bf16" and info["port"] == int(str(http.base_url).rsplit(":", 1)[1])
    load = http.get("/get_load").json()
    assert set(load) >= {"num_running_reqs", "num_waiting_reqs", "token_usage"}
    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"):
        r = http.post(path, json={})
        assert r.status_code == 400 and "use update_weights_from_disk" in r.json()["message"]
    r = http.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and "allowed abort, retract, in_place" in r.json()["error"]["message"]
    r = http.post("/abort_request", json={"rid": 5})
    assert r.status_code == 400 and "rid = 5: must be str" in r.json()["error"]["message"]


def test_session_routing_key_reuses_the_prefix(http):
    first = generate(http, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                      "ignore_eos": True}})
    turn2 = PROMPT + first["output_ids"] + TOK.encode("<|user|>more<|assistant|>")
    headers = {"X-SMG-Routing-Key": "session-7"}
    a = http.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0,
                                                                              "ignore_eos": True}}, headers=headers)
    b = http.post("/generate", json={"input_ids": turn2, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}},
                  headers=headers)
    assert a.json()["meta_info"]["cached_tokens"] == 0
    assert b.json()["meta_info"]["cached_tokens"] > 0


BAD_BODIES = [
    ({"input_ids": [1, "x"]}, "input_ids[1] = \"x\": token ids must be integers"),
    ({"input_ids": "hello"}, "input_ids = \"hello\""),
    ({"text": 5}, "text = 5: must be a string"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature = \"hot\": must be a number"),
    ({"input_ids": [1, 272]}, "input_ids[1] = 272: outside the vocabulary [0, 272)"),
    ({"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 25}}, "= 1025 exceeds the context length 1024"),
    ({"input_ids": [1], "sampling_params": {"top_p": 0}}, "top_p = 0: allowed (0, 1]"),
    ({"input_ids": [1], "sampling_params": {"top_q": 0.5}}, "sampling_params.top_q: unknown sampling_params key"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 1}}, "not implemented by the embedded engine"),
    ({"input_ids": [1], "text": "a"}, "got both"),
    ({"sampling_params": {}}, "got neither"),
    ({"input_ids": [1], "colour": "red"}, "colour: unknown request key"),
]


def test_bad_input_gets_400_and_others_keep_running(server):
    _engine, url = server

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S, trust_env=False) as c:
            good = asyncio.create_task(c.post("/generate", json={
                "input_ids": PROMPT, "return_logprob": True,
                "sampling_params": {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}}))

            async def running():
                return (await c.get("/get_load")).json()["num_running_reqs"] >= 1

            await wait_for(running, "the good request to run")
            for body, message in BAD_BODIES:
                r = await c.post("/generate", json=body)
                assert r.status_code == 400, (body, r.text)
                assert message in r.json()["error"]["message"], (message, r.text)
            # raw bodies: invalid JSON, a JSON array, an oversize body (declared and chunked)
            r = await c.post("/generate", content=b'{"input_ids": [1,', headers={"content-type": "application/json"})
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
            r = await c.post("/generate", json=[1, 2])
            assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
            big = {"input_ids": [1] * 40000}
            r = await c.post("/generate", json=big)
            assert r.status_code == 400 and "the limit is 65536 bytes" in r.json()["error"]["message"]

            async def chunked():
                yield b'{"input_ids": ['
                for _ in range(30):
                    yield b"1, " * 1000
                yield b"1]}"

            r = await c.post("/generate", content=chunked())
            assert r.status_code == 400 and "exceeds the limit of 65536 bytes" in r.json()["error"]["message"]
            assert not good.done() or (await good).status_code == 200
            out = (await good).json()
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 60}
            assert len(out["meta_info"]["output_token_logprobs"]) == 60
            # and the server still serves new requests
            r = await c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 2

    asyncio.run(run())


def test_client_gone_frees_its_request(server):
    """A client that disconnects (stream closed, or a timed-out POST) has its request aborted. The
    engine is paused meanwhile, so nothing but the abort can take the request out of the engine."""
    _engine, url = server

    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S, trust_env=False) as c:
            async def load_total():
                load = (await c.get("/get_load")).json()
                return load["num_running_reqs"] + load["num_waiting_reqs"]

            async def drained():
                return await load_total() == 0

            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
            async with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        await c.post("/pause_generation", json={"mode": "in_place"})
                        assert await load_total() == 1
                        break
            await wait_for(drained, "the closed stream's request to be aborted")
            async with httpx.AsyncClient(base_url=url, timeout=WAIT_S, trust_env=False) as impatient:
                task = asyncio.create_task(impatient.post("/generate", json=body))

                async def queued():
                    return await load_total() == 1

                await wait_for(queued, "the request to queue")
            with pytest.raises(httpx.HTTPError):            # the client went away before an answer
                await task
            await wait_for(drained, "the abandoned request to be aborted")
            await c.post("/continue_generation", json={})

    asyncio.run(run())
