"""SGLang's native `/generate` responses: `RequestResult` / `TokenOutput`s in -> SGLang's response dict out.

Pure (no HTTP, no engine): `build_response` answers one finished (or aborted) request, `response_dict` also
each streamed chunk; `render_text` trims a matched stop token from `text` unless no_stop_trim. The request
side (parsing, `GenerateItem`) is runner/sampler/protocol.py.

Routed experts (MoE): with the server started with `--enable-return-routed-experts`, a request's
`return_routed_experts: true` adds `meta_info.routed_experts` to its final response in SGLang's encoding:
base64 of the little-endian int32 C-order array [rows, num_hidden_layers, num_experts_per_tok] of the
experts each forwarded position was routed to, positions [routed_experts_start_len, prompt + completion - 1)
(the last sampled token is never forwarded). `encode_routed_experts` / `decode_routed_experts` are the
two directions; the client reads real SGLang's answers with the same decoder.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from mixfleet.runner.sampler.engine_api import RequestResult, TokenOutput

if TYPE_CHECKING:
    from mixfleet.runner.sampler.protocol import GenerateItem, _Tokenizer


def render_text(item: GenerateItem, output_ids: Sequence[int], finish_reason: Mapping | None,
                tokenizer: _Tokenizer) -> str:
    """`text` of a response: trims the matched stop token unless no_stop_trim (ids are never trimmed)."""
    ids = list(output_ids)
    if (finish_reason is not None and finish_reason.get("type") == "stop" and not item.no_stop_trim and ids):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=item.skip_special_tokens)


def _triple(lp: float, tid: int, item: GenerateItem, tokenizer: _Tokenizer) -> list:
    text = tokenizer.decode([tid], skip_special_tokens=False) if item.return_text_in_logprobs else None
    return [float(lp), int(tid), text]


def response_dict(item: GenerateItem, *, output_ids: Sequence[int], tokens: Sequence[TokenOutput],
                  finish_reason: Mapping | None, prompt_tokens: int, cached_tokens: int, weight_version: str,
                  e2e_latency: float, tokenizer: _Tokenizer, routed_experts: Any = None,
                  input_token_logprobs: Sequence[float | None] | None = None,
                  input_top_logprobs: Sequence[Sequence[tuple[float, int]] | None] | None = None) -> dict:
    """SGLang's /generate response for one item (also each streamed chunk, with finish_reason None; the
    routed experts and the prompt log-probs come with the final response only)."""
    fr = dict(finish_reason) if finish_reason is not None else None
    if fr is not None and fr.get("type") == "stop" and fr.get("matched") in item.stop_strs:
        fr["matched"] = item.stop_strs[fr["matched"]]          # SGLang reports a matched stop string as the string
    meta: dict[str, Any] = {
        "id": item.request.rid,
        "finish_reason": fr,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(output_ids),
        "cached_tokens": cached_tokens,
        "weight_version": weight_version,
        "e2e_latency": e2e_latency,
    }
    if item.return_logprob:
        meta["input_token_logprobs"], input_tops = _input_logprobs(item, fr, input_token_logprobs,
                                                                   input_top_logprobs, tokenizer)
        meta["output_token_logprobs"] = [_triple(t.logprob, t.token_id, item, tokenizer) for t in tokens]
        if item.top_logprobs_num > 0:
            meta["input_top_logprobs"] = input_tops
    if item.top_logprobs_num > 0:
        meta["output_top_logprobs"] = [[_triple(lp, tid, item, tokenizer) for lp, tid in t.top_logprobs]
                                       for t in tokens]
    if item.return_sampling_mask or item.sampling_logprobs_mode == "support":
        meta["output_token_sampling_mask"] = [list(t.mask_ids or []) for t in tokens]
        if item.sampling_logprobs_mode == "support":
            meta["output_token_sampling_logprobs"] = [[float(x) for x in (t.mask_logprobs or [])] for t in tokens]
        else:   # "selected" (SGLang's default): the sampled token's log-prob renormalized over its kept set
            meta["output_token_sampling_logprobs"] = [_selected_logprob(t) for t in tokens]
    meta["output_token_weight_versions"] = [t.weight_version for t in tokens]
    if item.return_routed_experts and routed_experts is not None and fr is not None:
        meta["routed_experts"] = encode_routed_experts(routed_experts)
    return {"text": render_text(item, output_ids, fr, tokenizer), "output_ids": list(output_ids), "meta_info": meta}


def _input_logprobs(item: GenerateItem, finish_reason: Mapping | None, lps: Sequence[float | None] | None,
                    tops: Sequence[Sequence[tuple[float, int]] | None] | None,
                    tokenizer: _Tokenizer) -> tuple[list, list]:
    """`input_token_logprobs` and `input_top_logprobs` as SGLang returns them (scheduler_output_processor_mixin
    `_process_input_token_logprobs` / `_process_input_top_logprobs`): one [logprob, id, text] triple per prompt
    position from logprob_start_len on, the first logprob None, and one list of top triples per position, the
    first None. logprob_start_len -1 (SGLang's scheduler sets it to the prompt length then) and the prompt
    length give empty lists; a streamed chunk before the end carries empty lists (the values come with the
    final response)."""
    prompt = item.request.input_ids
    start = item.logprob_start_len
    if start < 0 or start >= len(prompt):
        return [], []
    if lps is None:      # not computed yet (a stream chunk) or the request ended before its prefill (abort)
        return [], []
    ids = prompt[start:]
    token_lps = [_triple_or_none(lp, tid, item, tokenizer) for lp, tid in zip(lps, ids, strict=True)]
    top = [None if t is None else [_triple(lp, tid, item, tokenizer) for lp, tid in t] for t in (tops or [])]
    return token_lps, top


def _triple_or_none(lp: float | None, tid: int, item: GenerateItem, tokenizer: _Tokenizer) -> list:
    text = tokenizer.decode([tid], skip_special_tokens=False) if item.return_text_in_logprobs else None
    return [None if lp is None else float(lp), int(tid), text]


def _selected_logprob(t: TokenOutput) -> float | None:
    ids, lps = t.mask_ids or [], t.mask_logprobs or []
    for i, lp in zip(ids, lps, strict=False):
        if i == t.token_id:
            return float(lp)
    return None   # never for a well-formed engine record: the sampled token is always in its kept set


def build_response(item: GenerateItem, result: RequestResult, tokenizer: _Tokenizer) -> dict:
    """The final response of one finished (or aborted) request."""
    return response_dict(item, output_ids=result.output_ids, tokens=result.tokens, finish_reason=result.finish_reason,
                         prompt_tokens=result.prompt_tokens, cached_tokens=result.cached_tokens,
                         weight_version=result.weight_version, e2e_latency=result.e2e_latency, tokenizer=tokenizer,
                         routed_experts=result.routed_experts, input_token_logprobs=result.input_token_logprobs,
                         input_top_logprobs=result.input_top_logprobs)


def encode_routed_experts(experts: Any) -> str:
    """[rows, layers, top_k] expert ids (a torch tensor or array) -> SGLang's `meta_info.routed_experts`:
    base64 of the little-endian int32 C-order bytes."""
    arr = np.ascontiguousarray(np.asarray(experts.cpu() if hasattr(experts, "cpu") else experts), dtype="<i4")
    return base64.b64encode(arr.tobytes()).decode("ascii")


def decode_routed_experts(payload: str, *, num_layers: int, top_k: int, rows: int | None = None) -> np.ndarray:
    """SGLang's `meta_info.routed_experts` -> int32 array [rows, num_layers, top_k]. ValueError when the
    payload is not base64, or its size is not a whole number of rows (or not `rows` rows when given)."""
    try:
        raw = base64.b64decode(payload.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError, AttributeError) as e:
        raise ValueError(f"routed_experts: not a base64 string ({e})") from None
    per_row = 4 * num_layers * top_k
    if per_row <= 0 or len(raw) % per_row:
        raise ValueError(f"routed_experts: {len(raw)} bytes is not a whole number of rows of {num_layers} layers x "
                         f"{top_k} experts (int32)")
    arr = np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)
    if rows is not None and arr.shape[0] != rows:
        raise ValueError(f"routed_experts: {arr.shape[0]} rows, expected {rows} (prompt + completion - 1 - "
                         f"routed_experts_start_len)")
    return arr
