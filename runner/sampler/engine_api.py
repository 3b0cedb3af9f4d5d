"""The contract between the sampler engine and everything that drives it (HTTP server, tests, runner).

The engine (`mixfleet.runner.sampler.engine`) implements `SamplerEngine`; the SGLang-protocol server
(`mixfleet.runner.sampler.server`) parses HTTP requests into `EngineRequest`s and turns `TokenOutput`s and
`RequestResult`s into SGLang's response shapes. Nothing here does work: plain data + a Protocol.

Threading: the engine is driven by one background thread calling `step()` (or `run_forever`).
`add_request`, `abort`, `update_weights_from_disk`, `pause`, `resume` and `load` may be called from
any thread; callbacks (`on_token`, `on_finish`) run on the engine thread and must not block.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mixfleet.costmodel.specs.formats import formats

PRECISIONS = formats().engine_precisions           # weight formats the embedded engine serves (data/precisions.toml)
KV_CACHE_DTYPES = formats().engine_kv_dtypes
KERNELS = formats().kernels                         # matmul compute dtype after dequantization


TOP_P_ALLOWED = "a number in (0, 1]"


def valid_top_p(v: object) -> bool:
    """The one test of a top-p value (a request's, an evaluation's, a run's): a number in (0, 1], not a bool."""
    return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v <= 1


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0          # < 1e-6 means greedy
    top_p: float = 1.0                # in (0, 1]
    top_k: int = -1                   # -1: all
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()   # the tokenizer's EOS is always a stop unless ignore_eos
    min_new_tokens: int = 0
    ignore_eos: bool = False
    sampling_seed: int | None = None  # per-request RNG seed (reproducible samples)


@dataclass(frozen=True, kw_only=True)
class EngineRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = 0             # K for the top-K record (0: none)
    return_sampling_mask: bool = False    # record the kept set with log-probs renormalized over it
    session_id: str | None = None         # routing key; the engine may reuse this session's prefix
    return_routed_experts: bool = False   # MoE: return the experts of every forwarded token (SGLang's field)
    routed_experts_start_len: int = 0     # first position of that record, in [0, prompt length]
    logprob_start_len: int = -1           # with return_logprob, >= 0: prompt log-probs of positions
                                          # [logprob_start_len, prompt length) (SGLang's field; -1: none)


@dataclass(frozen=True, kw_only=True)
class TokenOutput:
    """One generated token and what the sampler knew when it sampled it."""

    token_id: int
    logprob: float                        # log_softmax(logits / T) over the FULL vocabulary
    top_logprobs: list[tuple[float, int]] = field(default_factory=list)  # K pairs, full-vocab normalized
    mask_ids: list[int] | None = None     # kept set (descending prob), sampled token always included
    mask_logprobs: list[float] | None = None  # renormalized over the kept set, aligned with mask_ids
    weight_version: str = "0"             # version of the weights that produced this token


@dataclass(frozen=True, kw_only=True)
class RequestResult:
    rid: str
    output_ids: list[int]                 # includes the stop / EOS token when one ended the request
    tokens: list[TokenOutput]
    finish_reason: dict                   # {"type": "stop", "matched": id} | {"type": "length", "length": n}
                                          # | {"type": "abort", "message": str}
    prompt_tokens: int
    cached_tokens: int                    # prompt tokens served from the prefix cache
    weight_version: str                   # version of the last generated token (or current, if none)
    e2e_latency: float                    # seconds from add_request to finish
    input_token_logprobs: list[float | None] | None = None   # logprob_start_len >= 0: one per prompt position
                                          # from logprob_start_len on, the first None (SGLang's shape); raw
                                          # logits (no temperature), full-vocabulary normalized
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None   # top_logprobs_num > 0 as well:
                                          # aligned with input_token_logprobs, the first None
    routed_experts: Any = None            # return_routed_experts: int32 tensor [rows, layers, top_k], the experts
                                          # of positions [routed_experts_start_len, prompt + output - 1)


class SamplerEngine(Protocol):
    vocab_size: int
    context_length: int                   # max prompt + generated tokens
    weight_version: str
    precision: str
    kv_cache_dtype: str
    model_path: str

    def add_request(self, req: EngineRequest, *, on_finish: Callable[[RequestResult], None],
                    on_token: Callable[[TokenOutput], None] | None = None) -> None: ...

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Finish the named (or all) requests now with finish_reason abort and their partial tokens."""
        ...

    def step(self) -> bool:
        """One scheduling iteration (admit, prefill, one decode step for the batch); True if it did work."""
        ...

    def run_forever(self, stop: threading.Event) -> None: ...

    def update_weights_from_disk(self, model_path: str | Path, weight_version: str | None = None) -> tuple[bool, str]:
        """Load + requantize a checkpoint, swapped in between decode steps; running requests continue
        on the new weights (their later tokens carry the new version). A failed load keeps the old
        weights serving and returns (False, reason)."""
        ...

    def pause(self, mode: str = "in_place") -> None: ...   # "abort" | "retract" | "in_place"

    def resume(self) -> None: ...

    def load(self) -> dict:
        """{"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage"}"""
        ...
