"""SGLang's native `/generate` protocol: the request types and request parsing/validation.

The embedded sampler server speaks the subset of SGLang's HTTP API that RL frameworks use, with
SGLang's own field names, defaults and shapes, so one client drives an embedded sampler and a real
SGLang server alike. This module is pure (no HTTP, no engine): JSON in -> `EngineRequest`s out
(`parse_json_body`, `parse_generate`). Every malformed request raises one `ProtocolError` whose
message names the field and the allowed values (the server turns it into HTTP 400
`{"error": {"message": ...}}`). The other direction, `RequestResult` / `TokenOutput`s in -> SGLang's
response dict out (and the routed-experts encoding), is runner/sampler/protocol_response.py.

Keys: every key SGLang's `GenerateReqInput` / `SamplingParams` accepts is accepted. Keys the
embedded engine implements take any valid value; keys it does not implement are accepted only
at their neutral value (e.g. `frequency_penalty: 0.0`, `regex: null`) and refused with a message
saying so otherwise. A key SGLang does not know is refused.

Routed experts (MoE): with the server started with `--enable-return-routed-experts`, a request may ask for
`return_routed_experts: true` (refused otherwise); the response carries them as protocol_response.py says.
"""
from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mixfleet.runner.sampler.engine_api import EngineRequest, SamplingParams

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024      # request bodies above this are refused (400)
DEFAULT_SAMPLING_MASK_MAX_TOKENS = 512         # SGLang's --sampling-mask-max-tokens
DEFAULT_MAX_BATCH_SIZE = 1024                  # prompts in one /generate call (after `n` expansion)
SAMPLING_EPS = 1e-6                            # temperature below this is greedy (SGLang's _SAMPLING_EPS)
SAMPLING_LOGPROBS_MODES = ("selected", "support")


class ProtocolError(ValueError):
    """A malformed request: becomes HTTP 400 `{"error": {"message": str}}`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict:
        return {"error": {"message": self.message}}


@dataclass(frozen=True, kw_only=True)
class ProtocolLimits:
    """What a request must fit: the served model's vocabulary and context, and server bounds."""

    vocab_size: int                              # token ids must lie in [0, vocab_size)
    context_length: int                          # prompt + max_new_tokens must not exceed this (tokens)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    sampling_mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS  # largest kept set returned per token
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE  # prompts per call
    enable_return_routed_experts: bool = False    # the server records MoE routing (SGLang's launch flag)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "max_body_bytes", "sampling_mask_max_tokens", "max_batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ProtocolLimits.{name} = {v!r}: must be an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class GenerateItem:
    """One prompt of a /generate call: the engine request plus what shapes its response."""

    request: EngineRequest
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_sampling_mask: bool = False
    sampling_logprobs_mode: str | None = None      # None | "selected" | "support"
    return_text_in_logprobs: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stop_strs: Mapping[int, str] = field(default_factory=dict)  # stop token id -> the `stop` string it came from
    stream_interval: int = 1                       # tokens between two stream chunks
    return_routed_experts: bool = False            # add meta_info.routed_experts to the final response
    logprob_start_len: int = -1                    # prompt log-probs from this position on (-1: SGLang's default)


@dataclass(frozen=True, kw_only=True)
class GenerateCall:
    """A parsed /generate body: one or more items, and how to answer."""

    items: list[GenerateItem]
    is_batch: bool                                 # the response is a list (one entry per item)
    stream: bool


class _Tokenizer:  # the part of ByteTokenizer this module uses (typing only)
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...


# --- the keys SGLang knows ---------------------------------------------------------------------

# sampling_params keys the embedded engine implements (any valid value)
_IMPLEMENTED_SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids",
                         "min_new_tokens", "n", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                         "no_stop_trim", "sampling_seed", "stream_interval")
# sampling_params keys SGLang knows that the engine does not implement: key -> neutral values
_NEUTRAL_SAMPLING: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "json_schema": (None,), "regex": (None,), "ebnf": (None,), "structural_tag": (None,),
    "stop_regex": (None, "", ()), "custom_params": (None, ()), "logit_bias": (None, ()),
}

# top-level keys the embedded server implements
_IMPLEMENTED_TOP = ("text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
                    "top_logprobs_num", "return_sampling_mask", "sampling_logprobs_mode", "return_text_in_logprobs",
                    "stream", "session_id", "routing_key", "return_routed_experts", "routed_experts_start_len")
# top-level keys that only label or log a request: any value of the right shape is fine
_INERT_TOP = ("log_metrics", "no_logs", "custom_labels", "conversation_id", "external_trace_header",
              "received_time", "http_worker_ipc")
# top-level keys SGLang knows that change what is computed: accepted at their neutral value only
_NEUTRAL_TOP: dict[str, tuple[Any, ...]] = {
    "input_embeds": (None,), "image_data": (None, ()), "video_data": (None, ()), "audio_data": (None, ()),
    "mm_hashes": (None,), "mm_content_hashes": (None,), "use_audio_in_video": (False,), "video_config": (None,),
    "token_ids_logprob": (None, ()), "return_flat_raw_top_logprobs": (False,),
    "return_flat_raw_top_logprobs_b64": (False,), "return_flat_raw_output_top_logprobs": (False,),
    "return_hidden_states": (False,),
    "return_indexer_topk": (False,), "modalities": (None,), "session_params": (None,), "lora_path": (None,),
    "lora_id": (None,), "custom_logit_processor": (None,), "positional_embed_overrides": (None,),
    "bootstrap_host": (None,), "bootstrap_port": (None,), "bootstrap_room": (None,), "bootstrap_pair_key": (None,),
    "decode_tp_size": (None,), "routed_dp_rank": (None, 0), "data_parallel_rank": (None, 0),
    "disagg_prefill_dp_rank": (None,), "kv_router_hint": (None,), "kv_hints": (None,), "background": (False,),
    "require_reasoning": (False,), "max_thinking_tokens": (None,), "priority": (None,), "extra_key": (None, ""),
    "cache_salt": (None, ""), "return_bytes": (False,), "return_entropy": (False,),
    "return_prompt_token_ids": (False,), "need_wait_for_mm_inputs": (None,), "num_items_assigned": (None,),
    "encoder_urls": (None,), "max_dynamic_patch": (None,), "min_dynamic_patch": (None,),
    "image_max_dynamic_patch": (None,), "video_max_dynamic_patch": (None,), "images_config": (None,),
    "multi_item_delimiter_indices": (None,), "token_indices_to_pool": (None,),
}


# --- small typed getters (bool is not an int here; NaN fails every range) ----------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, int | float)) and not isinstance(v, bool)


def _show(v: Any) -> str:
    s = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _get_bool(d: Mapping, key: str, default: bool, where: str) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ProtocolError(f"{where}{key} = {_show(v)}: must be true or false")
    return v


def _get_int(d: Mapping, key: str, default: int | None, where: str, *, lo: int | None = None,
             hi: int | None = None, allowed: str = "") -> int | None:
    v = d.get(key)
    if v is None:
        return default
    if not _is_int(v):
        raise ProtocolError(f"{where}{key} = {_show(v)}: must be an integer{' ' + allowed if allowed else ''}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ProtocolError(f"{where}{key} = {v}: allowed {allowed or f'[{lo}, {hi}]'}")
    return v


def _get_float(d: Mapping, key: str, default: float, where: str) -> float:
    v = d.get(key)
    if v is None:
        return default
    if not _is_num(v):
        raise ProtocolError(f"{where}{key} = {_show(v)}: must be a number")
    return float(v)


def _is_neutral(v: Any, neutral: tuple[Any, ...]) -> bool:
    for n in neutral:
        if n == () and isinstance(v, list | dict | str) and len(v) == 0:
            return True
        if n is None and v is None:
            return True
        if n is not None and n != () and type(v) is type(n) and v == n:
            return True
    return False


def _neutral_text(neutral: tuple[Any, ...]) -> str:
    return " or ".join("an empty list/object" if n == () else json.dumps(n) for n in neutral)


# --- request parsing ---------------------------------------------------------------------------

def parse_json_body(body: bytes, max_body_bytes: int) -> Any:
    """Bytes -> JSON value; refuses oversize bodies and invalid JSON / UTF-8."""
    if len(body) > max_body_bytes:
        raise ProtocolError(f"request body is {len(body)} bytes; the limit is {max_body_bytes} bytes")
    if not body.strip():
        return {}
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("request body is nested too deeply") from None
    if b"\\u" in body or b"\xed" in body:     # a surrogate can only come from an escape or raw ED A0..BF bytes
        _refuse_lone_surrogates(obj)
    return obj


def _refuse_lone_surrogates(obj: Any) -> None:
    """JSON lets a string hold a lone UTF-16 surrogate ("\\ud800"); Python keeps it, and it cannot be encoded
    as UTF-8 (tokenizing it, or echoing it back as a rid, raised a 500 and reset the connection). Refused here,
    naming the field (a path like `text[0]` or `sampling_params.stop`). Iterative: the body is bounded, its
    depth is not."""
    todo: list[tuple[str, Any]] = [("", obj)]
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            _check_utf8(path or "the body", v)
        elif isinstance(v, dict):
            for k, item in v.items():
                _check_utf8(f"{path + '.' if path else ''}{k!r} (a key)", k)
                todo.append((f"{path + '.' if path else ''}{k}", item))
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(v))


def _check_utf8(where: str, s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = s[e.start]
        raise ProtocolError(f"{where}: holds a lone UTF-16 surrogate (\\u{ord(bad):04x} at character {e.start}); "
                            "allowed: valid Unicode text (surrogates only as a high + low pair, "
                            "e.g. \\ud83d\\ude00)") from None


def _check_keys(obj: Mapping, implemented: Sequence[str], inert: Sequence[str],
                neutral: Mapping[str, tuple[Any, ...]], where: str, what: str) -> None:
    for key, v in obj.items():
        if key in implemented or key in inert:
            continue
        if key in neutral:
            if not _is_neutral(v, neutral[key]):
                raise ProtocolError(f"{where}{key} = {_show(v)}: not implemented by the embedded engine; "
                                    f"only its neutral value ({_neutral_text(neutral[key])}) is accepted")
            continue
        known = sorted((*implemented, *neutral))
        raise ProtocolError(f"{where}{key}: unknown {what} key; SGLang's keys are: {', '.join(known)}")


def _per_item(obj: Mapping, key: str, n: int, is_batch: bool) -> list[Any]:
    """A top-level field that may be one value for all items or (batch) a list of one per item."""
    v = obj.get(key)
    if is_batch and isinstance(v, list):
        if len(v) != n:
            raise ProtocolError(f"{key}: a list of {len(v)} values for a batch of {n} prompts; "
                                f"give one value, or one per prompt")
        return list(v)
    return [v] * n


def _prompt_ids(obj: Mapping, limits: ProtocolLimits, tokenizer: _Tokenizer) -> tuple[list[list[int]], bool]:
    has_text = obj.get("text") is not None
    has_ids = obj.get("input_ids") is not None
    if has_text == has_ids:
        raise ProtocolError("give exactly one of `text` (string or list of strings) or `input_ids` "
                            f"(list of ints or list of lists of ints); got {'both' if has_text else 'neither'}")
    if has_text:
        text = obj["text"]
        if isinstance(text, str):
            prompts, is_batch = [text], False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, is_batch = list(text), True
        else:
            raise ProtocolError(f"text = {_show(text)}: must be a string or a non-empty list of strings")
        ids = [tokenizer.encode(t) for t in prompts]
        for b, row in enumerate(ids):
            bad = [t for t in row if not 0 <= t < limits.vocab_size]
            if bad:
                raise ProtocolError(f"text{f'[{b}]' if is_batch else ''}: encodes to id {bad[0]}, outside the "
                                    f"model's vocabulary [0, {limits.vocab_size})")
    else:
        raw = obj["input_ids"]
        if not isinstance(raw, list) or not raw:
            raise ProtocolError(f"input_ids = {_show(raw)}: must be a non-empty list of ints "
                                "or a list of lists of ints")
        is_batch = isinstance(raw[0], list)
        rows = raw if is_batch else [raw]
        ids = []
        for b, row in enumerate(rows):
            where = f"input_ids[{b}]" if is_batch else "input_ids"
            if not isinstance(row, list):
                raise ProtocolError(f"{where} = {_show(row)}: a batch must be a list of lists of ints")
            for j, t in enumerate(row):
                if not _is_int(t):
                    raise ProtocolError(f"{where}[{j}] = {_show(t)}: token ids must be integers")
                if not 0 <= t < limits.vocab_size:
                    raise ProtocolError(f"{where}[{j}] = {t}: outside the vocabulary [0, {limits.vocab_size})")
            ids.append(list(row))
    for b, row in enumerate(ids):
        if not row:
            raise ProtocolError(f"prompt {b} is empty: give at least one token")
    return ids, is_batch


def _parse_stop(sp: Mapping, tokenizer: _Tokenizer, where: str, vocab_size: int) -> tuple[list[int], dict[int, str]]:
    stop_ids: list[int] = []
    raw_ids = sp.get("stop_token_ids")
    if raw_ids is not None:
        if not isinstance(raw_ids, list) or not all(_is_int(t) for t in raw_ids):
            raise ProtocolError(f"{where}stop_token_ids = {_show(raw_ids)}: must be a list of integers")
        for t in raw_ids:
            if not 0 <= t < vocab_size:
                raise ProtocolError(f"{where}stop_token_ids: {t} is outside the vocabulary [0, {vocab_size})")
        stop_ids = list(dict.fromkeys(raw_ids))
    stop_strs: dict[int, str] = {}
    raw = sp.get("stop")
    if raw is None or raw == "" or raw == []:
        return stop_ids, stop_strs
    strs = [raw] if isinstance(raw, str) else raw
    if not isinstance(strs, list) or not all(isinstance(s, str) for s in strs):
        raise ProtocolError(f"{where}stop = {_show(raw)}: must be a string or a list of strings")
    for s in strs:
        toks = tokenizer.encode(s)
        if len(toks) != 1:
            raise ProtocolError(f"{where}stop = {_show(s)} is {len(toks)} tokens: the embedded engine matches stop "
                                f"strings of exactly one token (a special token like <|eos|> or one byte); "
                                f"use stop_token_ids for others")
        stop_strs.setdefault(toks[0], s)
        if toks[0] not in stop_ids:
            stop_ids.append(toks[0])
    return stop_ids, stop_strs


def _parse_sampling(sp: Any, prompt_len: int, limits: ProtocolLimits, tokenizer: _Tokenizer,
                    where: str) -> tuple[SamplingParams, dict[str, Any]]:
    """One sampling_params object -> (engine SamplingParams, text/stream options)."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise ProtocolError(f"{where.rstrip('.')} = {_show(sp)}: must be a JSON object")
    _check_keys(sp, _IMPLEMENTED_SAMPLING, (), _NEUTRAL_SAMPLING, where, "sampling_params")
    room = limits.context_length - prompt_len
    if room < 0:
        raise ProtocolError(f"the prompt is {prompt_len} tokens; the context length is {limits.context_length}")
    max_new = _get_int(sp, "max_new_tokens", 128, where, lo=0, allowed="an integer >= 0")
    if sp.get("max_new_tokens", 0) is None:   # SGLang: null = until the context is full
        max_new = room
    temperature = _get_float(sp, "temperature", 1.0, where)
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ProtocolError(f"{where}temperature = {_show(sp['temperature'])}: allowed a finite number >= 0 "
                            f"(< {SAMPLING_EPS} means greedy)")
    top_p = _get_float(sp, "top_p", 1.0, where)
    if not 0.0 < top_p <= 1.0:
        raise ProtocolError(f"{where}top_p = {_show(sp['top_p'])}: allowed (0, 1]")
    top_k = _get_int(sp, "top_k", -1, where, allowed="-1 (all) or >= 1")
    if top_k != -1 and top_k < 1:
        raise ProtocolError(f"{where}top_k = {top_k}: allowed -1 (all) or an integer >= 1")
    if top_k >= limits.vocab_size:
        top_k = -1
    min_p = _get_float(sp, "min_p", 0.0, where)
    if not 0.0 <= min_p <= 1.0:
        raise ProtocolError(f"{where}min_p = {_show(sp['min_p'])}: allowed [0, 1]")
    min_new = _get_int(sp, "min_new_tokens", 0, where, lo=0, hi=max_new, allowed=f"[0, max_new_tokens = {max_new}]")
    n = _get_int(sp, "n", 1, where, lo=1, hi=limits.max_batch_size, allowed=f"[1, {limits.max_batch_size}]")
    seed = sp.get("sampling_seed")
    if seed is not None and not _is_int(seed):
        raise ProtocolError(f"{where}sampling_seed = {_show(seed)}: must be an integer or null")
    stop_ids, stop_strs = _parse_stop(sp, tokenizer, where, limits.vocab_size)
    if prompt_len + max_new > limits.context_length:
        raise ProtocolError(f"prompt ({prompt_len} tokens) + {where}max_new_tokens ({max_new}) = "
                            f"{prompt_len + max_new} exceeds the context length {limits.context_length}")
    params = SamplingParams(max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            stop_token_ids=tuple(stop_ids), min_new_tokens=min_new,
                            ignore_eos=_get_bool(sp, "ignore_eos", False, where), sampling_seed=seed)
    opts = {"n": n, "stop_strs": stop_strs,
            "skip_special_tokens": _get_bool(sp, "skip_special_tokens", True, where),
            "spaces_between_special_tokens": _get_bool(sp, "spaces_between_special_tokens", True, where),
            "no_stop_trim": _get_bool(sp, "no_stop_trim", False, where),
            "stream_interval": _get_int(sp, "stream_interval", 1, where, lo=1, allowed="an integer >= 1")}
    return params, opts


def _kept_set_bound(params: SamplingParams, vocab_size: int) -> int:
    if params.temperature < SAMPLING_EPS:
        return 1
    return vocab_size if params.top_k == -1 else min(params.top_k, vocab_size)


def parse_generate(obj: Any, limits: ProtocolLimits, tokenizer: _Tokenizer, *,
                   routing_key: str | None = None) -> GenerateCall:
    """Validate a /generate JSON body into engine requests (raises ProtocolError on any fault)."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"the /generate body must be a JSON object; got {type(obj).__name__}")
    _check_keys(obj, _IMPLEMENTED_TOP, _INERT_TOP, _NEUTRAL_TOP, "", "request")
    prompts, is_batch = _prompt_ids(obj, limits, tokenizer)
    n_prompts = len(prompts)
    stream = _get_bool(obj, "stream", False, "")
    return_text_in_logprobs = _get_bool(obj, "return_text_in_logprobs", False, "")
    for key in ("session_id", "routing_key", "conversation_id"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise ProtocolError(f"{key} = {_show(obj[key])}: must be a string")
    session = obj.get("session_id") or obj.get("routing_key") or routing_key
    mode = obj.get("sampling_logprobs_mode")
    if mode is not None and mode not in SAMPLING_LOGPROBS_MODES:
        raise ProtocolError(f"sampling_logprobs_mode = {_show(mode)}: allowed null, "
                            + ", ".join(f'"{m}"' for m in SAMPLING_LOGPROBS_MODES))

    sps = obj.get("sampling_params")
    if isinstance(sps, list):
        if not is_batch or len(sps) != n_prompts:
            raise ProtocolError(f"sampling_params is a list of {len(sps)}: a list needs a batch of as many prompts "
                                f"(got {'a batch of ' + str(n_prompts) if is_batch else 'one prompt'})")
    else:
        sps = [sps] * n_prompts
    columns = {k: _per_item(obj, k, n_prompts, is_batch) for k in
               ("return_logprob", "top_logprobs_num", "logprob_start_len", "return_sampling_mask",
                "return_routed_experts", "routed_experts_start_len")}

    parsed = []
    for b in range(n_prompts):
        where = f"sampling_params[{b}]." if isinstance(obj.get("sampling_params"), list) else "sampling_params."
        params, opts = _parse_sampling(sps[b], len(prompts[b]), limits, tokenizer, where)
        row = {k: {k: v[b]} for k, v in columns.items()}
        return_logprob = _get_bool(row["return_logprob"], "return_logprob", False, "")
        top_k_num = _get_int(row["top_logprobs_num"], "top_logprobs_num", 0, "", lo=0, hi=limits.vocab_size,
                             allowed=f"[0, vocab size {limits.vocab_size}]")
        start = _get_int(row["logprob_start_len"], "logprob_start_len", -1, "", lo=-1, hi=len(prompts[b]),
                         allowed=f"-1 (no prompt log-probs) or [0, prompt length {len(prompts[b])}]")
        mask = _get_bool(row["return_sampling_mask"], "return_sampling_mask", False, "")
        if mask or mode == "support":
            bound = _kept_set_bound(params, limits.vocab_size)
            if bound > limits.sampling_mask_max_tokens:
                raise ProtocolError(f"return_sampling_mask: the kept set could hold {bound} tokens, more than the "
                                    f"server's sampling_mask_max_tokens = {limits.sampling_mask_max_tokens}; "
                                    f"set sampling_params.top_k in [1, {limits.sampling_mask_max_tokens}]")
        routed = _get_bool(row["return_routed_experts"], "return_routed_experts", False, "")
        if routed and not limits.enable_return_routed_experts:
            raise ProtocolError("return_routed_experts = true: the server was not started with "
                                "--enable-return-routed-experts (a MoE model's routing is recorded only then)")
        routed_start = _get_int(row["routed_experts_start_len"], "routed_experts_start_len", 0, "", lo=0,
                                hi=len(prompts[b]), allowed=f"[0, prompt length {len(prompts[b])}]")
        parsed.append((b, params, opts, return_logprob, top_k_num, mask, routed, routed_start, start))

    # `n` expands the batch prompt-major per copy, as SGLang does: [p0, p1, p0, p1, ...]
    n = parsed[0][2]["n"]
    if any(p[2]["n"] != n for p in parsed):
        raise ProtocolError("sampling_params.n must be the same for every prompt of a batch")
    total = n_prompts * n
    if total > limits.max_batch_size:
        raise ProtocolError(f"{total} prompts in one call; the limit is {limits.max_batch_size}")
    if n > 1:
        is_batch = True
    rids = _rids(obj.get("rid"), n_prompts, n, is_batch)

    items = []
    for copy in range(n):
        for b, params, opts, return_logprob, top_k_num, mask, routed, routed_start, start in parsed:
            rid = rids[copy * n_prompts + b]
            req = EngineRequest(rid=rid, input_ids=list(prompts[b]), params=params, return_logprob=return_logprob,
                                top_logprobs_num=top_k_num, return_sampling_mask=mask or mode == "support",
                                session_id=session, return_routed_experts=routed,
                                routed_experts_start_len=routed_start, logprob_start_len=start)
            items.append(GenerateItem(request=req, return_logprob=return_logprob, top_logprobs_num=top_k_num,
                                      return_sampling_mask=mask, sampling_logprobs_mode=mode,
                                      return_text_in_logprobs=return_text_in_logprobs,
                                      skip_special_tokens=opts["skip_special_tokens"],
                                      spaces_between_special_tokens=opts["spaces_between_special_tokens"],
                                      no_stop_trim=opts["no_stop_trim"], stop_strs=opts["stop_strs"],
                                      stream_interval=opts["stream_interval"], return_routed_experts=routed,
                                      logprob_start_len=start))
    return GenerateCall(items=items, is_batch=is_batch, stream=stream)


def _rids(rid: Any, n_prompts: int, n: int, is_batch: bool) -> list[str]:
    total = n_prompts * n
    if rid is None:
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, str) and rid:
        return [rid] if not is_batch else [f"{rid}_{i}" for i in range(total)]
    if isinstance(rid, list) and is_batch and all(isinstance(r, str) and r for r in rid):
        if len(rid) != n_prompts:
            raise ProtocolError(f"rid: {len(rid)} ids for a batch of {n_prompts} prompts")
        if len(set(rid)) != len(rid):
            raise ProtocolError("rid: duplicate request ids in one batch")
        return list(rid) if n == 1 else [f"{r}_{c}" for c in range(n) for r in rid]
    raise ProtocolError(f"rid = {_show(rid)}: must be a non-empty string, or (batch) a list of one string per prompt")
