"""runner/sampler/protocol.py and protocol_response.py without HTTP: SGLang's /generate body -> engine requests,
and results -> responses.

Covers: SGLang's defaults; batch forms (input_ids lists, text lists, per-item sampling_params, rid
expansion, `n`); keys SGLang knows but the engine does not implement (accepted at the neutral
value only); unknown keys; type and range errors, each with a message naming the field; and the
response shape built from a RequestResult (triples, top-K, mask modes, stop trimming).
"""

from __future__ import annotations

import math

import pytest
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.engine_api import RequestResult, SamplingParams, TokenOutput
from mixfleet.runner.sampler.protocol import (
    ProtocolError,
    ProtocolLimits,
    parse_generate,
    parse_json_body,
)
from mixfleet.runner.sampler.protocol_response import build_response

TOK = ByteTokenizer()
LIMITS = ProtocolLimits(vocab_size=272, context_length=64, max_body_bytes=1000, sampling_mask_max_tokens=16)


def parse(obj, **kw):
    return parse_generate(obj, LIMITS, TOK, **kw)


def test_defaults_are_sglangs():
    call = parse({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}})
    assert not call.is_batch and not call.stream and len(call.items) == 1
    item = call.items[0]
    req = item.request
    assert req.input_ids == [5, 6, 7]
    assert req.params == SamplingParams(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                                        stop_token_ids=(), min_new_tokens=0, ignore_eos=False, sampling_seed=None)
    assert len(req.rid) == 32 and int(req.rid, 16) >= 0          # random hex
    assert (item.return_logprob, item.top_logprobs_num, item.return_sampling_mask) == (False, 0, False)
    assert (item.skip_special_tokens, item.spaces_between_special_tokens, item.no_stop_trim) == (True, True, False)
    # max_new_tokens defaults to 128: over this context of 64
    with pytest.raises(ProtocolError, match="exceeds the context length 64"):
        parse({"input_ids": [5]})
    # null max_new_tokens = until the context is full
    assert parse({"input_ids": [5] * 4, "sampling_params": {"max_new_tokens": None}}).items[0].request.params \
        .max_new_tokens == 60


def test_text_prompt_is_tokenized_and_routing_key_becomes_session():
    call = parse({"text": "hi<|user|>", "sampling_params": {"max_new_tokens": 1}}, routing_key="sess-1")
    req = call.items[0].request
    assert req.input_ids == TOK.encode("hi<|user|>") == [104 + 16, 105 + 16, 4]
    assert req.session_id == "sess-1"
    # an explicit session_id in the body wins over the header
    call = parse({"text": "hi", "session_id": "s2", "sampling_params": {"max_new_tokens": 1}}, routing_key="sess-1")
    assert call.items[0].request.session_id == "s2"


def test_batches_rids_and_n():
    call = parse({"input_ids": [[1, 2], [3]], "rid": "r", "return_logprob": [True, False],
                  "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "temperature": 0}]})
    assert call.is_batch
    assert [it.request.rid for it in call.items] == ["r_0", "r_1"]
    assert [it.request.params.max_new_tokens for it in call.items] == [2, 3]
    assert [it.return_logprob for it in call.items] == [True, False]
    call = parse({"text": ["a", "bc"], "rid": ["x", "y"], "sampling_params": {"max_new_tokens": 1}})
    assert [(it.request.rid, it.request.input_ids) for it in call.items] == [("x", [113]), ("y", [114, 115])]
    # n copies, prompt-major per copy, as SGLang expands them; a single prompt with n > 1 is a batch
    call = parse({"input_ids": [[1], [2]], "rid": ["a", "b"], "sampling_params": {"n": 2, "max_new_tokens": 1}})
    assert [(it.request.rid, it.request.input_ids) for it in call.items] == \
        [("a_0", [1]), ("b_0", [2]), ("a_1", [1]), ("b_1", [2])]
    call = parse({"input_ids": [1], "sampling_params": {"n": 3, "max_new_tokens": 1}})
    assert call.is_batch and len(call.items) == 3


def test_neutral_keys_accepted_and_others_refused():
    ok = {"frequency_penalty": 0.0, "presence_penalty": 0, "repetition_penalty": 1.0, "regex": None,
          "json_schema": None, "ebnf": None, "logit_bias": {}, "custom_params": None, "stop_regex": [],
          "skip_special_tokens": False, "spaces_between_special_tokens": True, "no_stop_trim": True,
          "sampling_seed": 7, "min_new_tokens": 1, "ignore_eos": True, "stream_interval": 2, "max_new_tokens": 4}
    call = parse({"input_ids": [1], "sampling_params": ok, "lora_path": None, "return_hidden_states": False,
                  "log_metrics": True, "image_data": None, "logprob_start_len": -1, "custom_labels": {"a": "b"}})
    item = call.items[0]
    assert item.request.params.sampling_seed == 7 and item.request.params.ignore_eos
    assert item.no_stop_trim and not item.skip_special_tokens and item.stream_interval == 2
    for key, value in [("frequency_penalty", 0.5), ("repetition_penalty", 1.1), ("regex", "a+"),
                       ("logit_bias", {"5": 1.0}), ("json_schema", "{}")]:
        with pytest.raises(ProtocolError, match=f"sampling_params.{key} = .*not implemented by the embedded engine"):
            parse({"input_ids": [1], "sampling_params": {key: value, "max_new_tokens": 1}})
    for key, value in [("lora_path", "x"), ("return_hidden_states", True), ("image_data", "img.png")]:
        with pytest.raises(ProtocolError, match=f"{key}.*not implemented"):
            parse({"input_ids": [1, 2], key: value, "sampling_params": {"max_new_tokens": 1}})


@pytest.mark.parametrize("body, message", [
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "temprature": 1.0}},
     "sampling_params.temprature: unknown sampling_params key"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "return_logprobs": True},
     "return_logprobs: unknown request key"),
    ({"input_ids": [1], "text": "a"}, "exactly one of `text`.*got both"),
    ({"sampling_params": {}}, "exactly one of `text`.*got neither"),
    ({"input_ids": []}, "input_ids = \\[\\]: must be a non-empty list"),
    ({"input_ids": [1, "2"]}, "input_ids\\[1\\] = \"2\": token ids must be integers"),
    ({"input_ids": [1, True]}, "input_ids\\[1\\] = true: token ids must be integers"),
    ({"input_ids": [1, 272]}, "input_ids\\[1\\] = 272: outside the vocabulary \\[0, 272\\)"),
    ({"input_ids": [[1], [-1]]}, "input_ids\\[1\\]\\[0\\] = -1: outside the vocabulary"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens = \"5\": must be an integer"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 64}},
     "prompt \\(1 tokens\\) \\+ sampling_params.max_new_tokens \\(64\\) = 65 exceeds the context length 64"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "top_p": 0}}, "top_p = 0: allowed \\(0, 1\\]"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "top_p": 1.5}}, "top_p = 1.5: allowed"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "top_k": 0}}, "top_k = 0: allowed -1"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "temperature": -1}}, "temperature = -1"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "min_p": 2}}, "min_p = 2: allowed \\[0, 1\\]"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}}, "min_new_tokens = 3"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "stop_token_ids": [999]}},
     "stop_token_ids: 999 is outside the vocabulary"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "stop": "abc"}},
     "stop = \"abc\" is 3 tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "ignore_eos": "yes"}},
     "ignore_eos = \"yes\": must be true or false"),
    ({"input_ids": [1], "sampling_params": [{"max_new_tokens": 1}]}, "sampling_params is a list of 1"),
    ({"input_ids": [1], "sampling_params": "fast"}, "sampling_params = \"fast\": must be a JSON object"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "stream": 1}, "stream = 1: must be true or false"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "top_logprobs_num": 300},
     "top_logprobs_num = 300: allowed \\[0, vocab size 272\\]"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "sampling_logprobs_mode": "all"},
     "sampling_logprobs_mode = \"all\": allowed null, \"selected\", \"support\""),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}, "return_sampling_mask": True},
     "the kept set could hold 272 tokens, more than the server's sampling_mask_max_tokens = 16"),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"], "sampling_params": {"max_new_tokens": 1}}, "duplicate request ids"),
    ({"input_ids": [[1], [2]], "rid": ["a"], "sampling_params": {"max_new_tokens": 1}}, "rid: 1 ids for a batch of 2"),
    ([1, 2, 3], "must be a JSON object; got list"),
])
def test_bad_requests_name_the_field(body, message):
    with pytest.raises(ProtocolError, match=message):
        parse(body)


def test_sampling_mask_bound_and_stop_strings():
    # top_k bounds the kept set; greedy keeps one token
    call = parse({"input_ids": [1], "return_sampling_mask": True,
                  "sampling_params": {"max_new_tokens": 1, "top_k": 16}})
    assert call.items[0].request.return_sampling_mask
    parse({"input_ids": [1], "return_sampling_mask": True, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    # a stop string of one token becomes a stop id, remembered for the response
    item = parse({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "stop": ["<|endcall|>", "\n"],
                                                        "stop_token_ids": [7]}}).items[0]
    assert item.request.params.stop_token_ids == (7, 8, 10 + 16)
    assert dict(item.stop_strs) == {8: "<|endcall|>", 26: "\n"}


def test_body_limits():
    assert parse_json_body(b'{"a": 1}', 1000) == {"a": 1}
    assert parse_json_body(b"  ", 1000) == {}
    with pytest.raises(ProtocolError, match="request body is 1001 bytes; the limit is 1000 bytes"):
        parse_json_body(b" " * 1001, 1000)
    with pytest.raises(ProtocolError, match="not valid JSON"):
        parse_json_body(b'{"a": ', 1000)
    with pytest.raises(ProtocolError, match="not valid JSON"):
        parse_json_body(b"\xff\xfe", 1000)
    with pytest.raises(ProtocolError, match="nested too deeply"):
        parse_json_body(b"[" * 100_000 + b"]" * 100_000, 1_000_000)


def _tok(tid: int, lp: float, version: str, *, mask: list[tuple[int, float]] | None = None) -> TokenOutput:
    return TokenOutput(token_id=tid, logprob=lp, top_logprobs=[(lp, tid), (lp - 1.0, 99)],
                       mask_ids=[m[0] for m in mask] if mask else None,
                       mask_logprobs=[m[1] for m in mask] if mask else None, weight_version=version)


def test_response_shape_from_result():
    body = {"input_ids": [1, 2], "rid": "q", "return_logprob": True, "top_logprobs_num": 2,
            "return_sampling_mask": True, "sampling_params": {"max_new_tokens": 3, "top_k": 2, "stop": "<|endcall|>"}}
    half = math.log(0.5)
    toks = [_tok(120, -0.5, "0", mask=[(120, half), (99, half)]), _tok(8, -0.1, "1", mask=[(8, -0.01), (99, -4.6)])]
    result = RequestResult(rid="q", output_ids=[120, 8], tokens=toks, finish_reason={"type": "stop", "matched": 8},
                           prompt_tokens=2, cached_tokens=1, weight_version="1", e2e_latency=0.25)
    item = parse(body).items[0]
    out = build_response(item, result, TOK)
    assert out == {
        "text": "h",                                   # the matched stop token is trimmed from text only
        "output_ids": [120, 8],
        "meta_info": {
            "id": "q", "finish_reason": {"type": "stop", "matched": "<|endcall|>"},
            "prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 1, "weight_version": "1",
            "e2e_latency": 0.25,
            "input_token_logprobs": [], "input_top_logprobs": [],  # logprob_start_len -1: none (as SGLang 0.5.23)
            "output_token_logprobs": [[-0.5, 120, None], [-0.1, 8, None]],
            "output_top_logprobs": [[[-0.5, 120, None], [-1.5, 99, None]], [[-0.1, 8, None], [-1.1, 99, None]]],
            "output_token_sampling_mask": [[120, 99], [8, 99]],
            "output_token_sampling_logprobs": [half, -0.01],        # "selected" mode: the sampled token's
            "output_token_weight_versions": ["0", "1"],
        },
    }
    support = parse({**body, "sampling_logprobs_mode": "support", "return_text_in_logprobs": True}).items[0]
    out = build_response(support, result, TOK)
    assert out["meta_info"]["output_token_sampling_logprobs"] == [[half, half], [-0.01, -4.6]]
    assert out["meta_info"]["output_token_logprobs"] == [[-0.5, 120, "h"], [-0.1, 8, "<|endcall|>"]]
    keep = parse({**body, "sampling_params": {**body["sampling_params"], "no_stop_trim": True,
                                              "skip_special_tokens": False}}).items[0]
    assert build_response(keep, result, TOK)["text"] == "h<|endcall|>"
