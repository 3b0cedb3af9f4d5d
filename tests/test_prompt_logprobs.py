"""Prompt (input) log-probs of the embedded engine, through a real server, checked against a direct forward pass.

SGLang's shape (sglang 0.5.23, srt/managers/scheduler_components/logprob_result_processor.py
`_process_input_token_logprobs` / `_process_input_top_logprobs`, and tokenizer_manager.py
`add_logprob_to_meta_info`): with `return_logprob` and `logprob_start_len` = k >= 0, `meta_info.input_token_logprobs`
has one [logprob, token_id, text] per prompt position k..T-1, the first logprob None; `input_top_logprobs` (with
`top_logprobs_num` > 0) one list of top triples per position, the first None. -1 (the default) gives empty lists.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from sampler_helpers import make_checkpoint

TOL = 2e-4
PROMPT = "The cat sat on the mat, and then the cat sat again."


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from mixfleet.runner.sampler.engine import Engine
    from mixfleet.runner.sampler.engine.model import load_weights
    from mixfleet.runner.sampler.server import ServerArgs
    from mixfleet.runner.sampler.server_launch import start_in_thread

    ck = make_checkpoint(tmp_path_factory.mktemp("ck"), seed=5, weight_version="v0")
    engine = Engine(ck, precision="fp32", kv_cache_dtype="fp32", kernel="fp32")
    handle = start_in_thread(engine, server_args=ServerArgs(port=0))
    ref_w = load_weights(ck, precision="fp32", kernel="fp32")
    try:
        with httpx.Client(base_url=handle.url, timeout=60) as http:
            yield http, engine, ref_w
    finally:
        handle.stop()


def reference(w, ids: list[int]) -> torch.Tensor:
    """log_softmax of one full fp32 forward: row i is the distribution of token i + 1."""
    from mixfleet.runner.sampler.engine.model import forward_full

    return torch.log_softmax(forward_full(w, ids, "fp32").double(), dim=-1)


def post(http, body: dict, status: int = 200):
    r = http.post("/generate", json=body)
    assert r.status_code == status, r.text
    return r.json()


def check_against_reference(meta: dict, ids: list[int], start: int, ref: torch.Tensor, top: int) -> None:
    itl = meta["input_token_logprobs"]
    assert len(itl) == len(ids) - start
    assert [e[1] for e in itl] == ids[start:]
    assert itl[0][0] is None
    for i, (lp, tid, _text) in enumerate(itl[1:], start=start + 1):
        assert abs(lp - ref[i - 1, tid].item()) < TOL, (i, lp, ref[i - 1, tid].item())
    if top:
        tops = meta["input_top_logprobs"]
        assert len(tops) == len(itl) and tops[0] is None
        for i, row in enumerate(tops[1:], start=start + 1):
            vals, idx = ref[i - 1].topk(top)
            assert [t[1] for t in row] == idx.tolist()
            assert max(abs(a[0] - b) for a, b in zip(row, vals.tolist(), strict=True)) < TOL
    else:
        assert "input_top_logprobs" not in meta


@pytest.mark.parametrize("start, max_new, top", [(0, 0, 0), (0, 3, 4), (7, 0, 5), (7, 2, 0), ("last", 0, 3)])
def test_input_logprobs_equal_a_full_fp32_forward(setup, start, max_new, top):
    http, engine, w = setup
    ids = engine.tokenizer.encode(PROMPT)
    start = len(ids) - 1 if start == "last" else start
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": top,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    out = post(http, body)
    meta = out["meta_info"]
    check_against_reference(meta, ids, start, reference(w, ids), top)
    assert meta["prompt_tokens"] == len(ids)
    assert len(out["output_ids"]) == max_new == len(meta["output_token_logprobs"])
    assert meta["finish_reason"] == {"type": "length", "length": max_new}
    if max_new:   # generation goes on after the scored prefill: its greedy token is the forward's argmax
        assert out["output_ids"][0] == int(reference(w, ids)[-1].argmax())


def test_text_in_logprobs_and_batches(setup):
    http, engine, w = setup
    texts = [PROMPT, "Another, shorter prompt."]
    out = post(http, {"text": texts, "return_logprob": True, "return_text_in_logprobs": True,
                      "logprob_start_len": 2, "sampling_params": {"max_new_tokens": 0}})
    assert isinstance(out, list) and len(out) == 2
    for text, r in zip(texts, out, strict=True):
        ids = engine.tokenizer.encode(text)
        check_against_reference(r["meta_info"], ids, 2, reference(w, ids), 0)
        assert [e[2] for e in r["meta_info"]["input_token_logprobs"]] == [engine.tokenizer.decode([t]) for t in ids[2:]]


def test_prefix_cache_hit_still_gives_exact_values(setup):
    """A session's cached prefix is reused only up to logprob_start_len, so every scored position is forwarded."""
    http, engine, w = setup
    ids = engine.tokenizer.encode(PROMPT)
    first = post(http, {"input_ids": ids, "session_id": "s1",
                        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}})
    longer = ids + first["output_ids"] + engine.tokenizer.encode(" more text")
    for start in (len(ids) - 4, len(ids) + 2, 0):
        out = post(http, {"input_ids": longer, "session_id": "s1", "return_logprob": True, "top_logprobs_num": 2,
                          "logprob_start_len": start, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        meta = out["meta_info"]
        assert meta["cached_tokens"] == min(start, len(ids) + 3), (start, meta["cached_tokens"])
        check_against_reference(meta, longer, start, reference(w, longer), 2)


def test_default_and_prompt_length_start_give_empty_lists(setup):
    http, engine, _ = setup
    ids = engine.tokenizer.encode("abc")
    for start in (None, -1, len(ids)):
        for max_new in (0, 2):
            body = {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
                    "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
            if start is not None:
                body["logprob_start_len"] = start
            meta = post(http, body)["meta_info"]
            assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
            assert len(meta["output_token_logprobs"]) == max_new
    meta = post(http, {"input_ids": ids, "logprob_start_len": 0, "sampling_params": {"max_new_tokens": 1}})["meta_info"]
    assert "input_token_logprobs" not in meta        # without return_logprob nothing is returned (as SGLang)


@pytest.mark.parametrize("extra, field", [
    ({"logprob_start_len": -2}, "logprob_start_len = -2"),
    ({"logprob_start_len": 4}, "logprob_start_len = 4: allowed -1 .*prompt length 3"),
    ({"logprob_start_len": 1.5}, "logprob_start_len = 1.5"),
    ({"logprob_start_len": True}, "logprob_start_len = true"),
    ({"top_logprobs_num": -1}, "top_logprobs_num = -1"),
    ({"top_logprobs_num": 10 ** 9}, "top_logprobs_num = 1000000000"),
])
def test_bad_values_are_400_naming_the_field(setup, extra, field):
    http, _, _ = setup
    out = post(http, {"input_ids": [1, 2, 3], "return_logprob": True, "sampling_params": {"max_new_tokens": 0},
                      **extra}, status=400)
    assert out["error"]["message"].startswith(field.split(":")[0])
    import re
    assert re.search(field, out["error"]["message"]), out["error"]["message"]


def test_scoring_is_chunked_over_positions(setup):
    """position_logprobs gives the same values whatever its chunk (memory is [chunk, vocab], never [T, vocab])."""
    from mixfleet.runner.sampler.engine.kvcache import KVPool
    from mixfleet.runner.sampler.engine.model import position_logprobs, prefill_many

    _, engine, w = setup
    ids = engine.tokenizer.encode(PROMPT)
    cfg = w.cfg
    kv = KVPool(num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                max_context=cfg.max_position_embeddings, kv_dtype="fp32", device="cpu")
    kv.ensure(1, len(ids))
    hidden: list[torch.Tensor] = []
    prefill_many(w, kv, [(0, ids, 0)], hidden_out=hidden)
    whole = position_logprobs(w, hidden[0][:-1], ids[1:], 3)
    for rows in (1, 5):
        lps, tops = position_logprobs(w, hidden[0][:-1], ids[1:], 3, chunk_rows=rows)
        assert len(lps) == len(whole[0]) and max(abs(a - b) for a, b in zip(lps, whole[0], strict=True)) < 1e-5
        assert [[t[1] for t in row] for row in tops] == [[t[1] for t in row] for row in whole[1]]
