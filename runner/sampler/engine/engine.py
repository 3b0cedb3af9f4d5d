"""`Engine`: the embedded sampler (continuous batching, sampling records, in-flight weight updates).

Implements `mixfleet.runner.sampler.engine_api.SamplerEngine`. One engine thread calls `step()` (or
`run_forever`); other threads add, abort, pause, resume and update weights. A step is:

    take new requests -> admit while the KV-token budget allows (prefill, reusing a session's
    cached prefix, sample the first token) -> one batched decode step for every running request
    -> finish those that hit a stop token or their length.

Each step captures the current `Weights` once, so a weight update (loaded and requantized on the
caller's thread, then swapped under the step lock) lands between steps: running requests keep
their KV and continue on the new weights, and every token carries the version that produced it.
The KV-token budget is a reservation: a request holds prompt + max_new_tokens tokens from
admission to finish, so a running request never has to be preempted; excess requests wait (FIFO).

The engine's settings (`EngineConfig`, checked on construction) are in config.py.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.engine.config import EngineConfig
from mixfleet.runner.sampler.engine.kvcache import KVPool, SessionKV
from mixfleet.runner.sampler.engine.model import (
    Weights,
    decode,
    load_weights,
    position_logprobs,
    prefill_many,
    same_architecture,
)
from mixfleet.runner.sampler.engine.sampling import GREEDY_TEMPERATURE, RowParams, sample_batch
from mixfleet.runner.sampler.engine_api import (
    TOP_P_ALLOWED,
    EngineRequest,
    RequestResult,
    SamplingParams,
    TokenOutput,
    valid_top_p,
)

log = logging.getLogger(__name__)

PAUSE_MODES = ("in_place", "abort", "retract")


@dataclass
class _Running:
    req: EngineRequest
    on_finish: Callable[[RequestResult], None]
    on_token: Callable[[TokenOutput], None] | None
    rng: random.Random
    stop_ids: frozenset[int]
    row: RowParams
    t0_s: float
    output: list[int] = field(default_factory=list)
    tokens: list[TokenOutput] = field(default_factory=list)
    cached_tokens: int = 0
    kv_len: int = 0                          # tokens whose KV is in the slot
    routing: list[torch.Tensor] = field(default_factory=list)   # experts of those tokens, [n, layers, k] chunks
    input_lps: list[float | None] | None = None      # prompt log-probs (logprob_start_len >= 0), once computed
    input_tops: list[list[tuple[float, int]] | None] | None = None

    @property
    def wants_input_logprobs(self) -> bool:
        return (self.req.return_logprob and 0 <= self.req.logprob_start_len < len(self.req.input_ids)
                and self.input_lps is None)

    @property
    def reserved_tokens(self) -> int:
        return len(self.req.input_ids) + self.req.params.max_new_tokens


def _stop_ids(p: SamplingParams, eos_id: int) -> frozenset[int]:
    return frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else {eos_id})


class Engine:
    """The embedded sampler engine. See the module docstring; thread rules in engine_api.py."""

    def __init__(self, model_path: str | Path, *, precision: str = "bf16", kv_cache_dtype: str = "bf16",
                 kernel: str | None = None, max_total_tokens: int = 65536, max_running_requests: int = 64,
                 sampling_mask_max_tokens: int = 512, fp8_scaling: str = "block", fp8_scaled_mm: bool = False,
                 device: str = "cpu", seed: int = 0, max_cached_sessions: int = 256,
                 weight_version: str | None = None, weight_noise: float = 0.0,
                 enable_return_routed_experts: bool = False) -> None:
        self.config = EngineConfig(precision=precision, kv_cache_dtype=kv_cache_dtype, kernel=kernel,
                                   weight_noise=weight_noise, enable_return_routed_experts=enable_return_routed_experts,
                                   max_total_tokens=max_total_tokens, max_running_requests=max_running_requests,
                                   sampling_mask_max_tokens=sampling_mask_max_tokens, fp8_scaling=fp8_scaling,
                                   fp8_scaled_mm=fp8_scaled_mm, device=device, seed=seed,
                                   max_cached_sessions=max_cached_sessions)
        self.model_path = str(model_path)
        self._weights: Weights = self._load(model_path, weight_version)
        cfg = self._weights.cfg
        if enable_return_routed_experts and not cfg.is_moe:
            raise ValueError(f"enable_return_routed_experts: the model at {model_path} has no experts (model_type "
                             f"{cfg.model_type!r}); allowed only for model_type 'qwen3_moe'")
        self._record_routing = enable_return_routed_experts
        try:
            self.tokenizer = ByteTokenizer.load(model_path)
        except FileNotFoundError:
            self.tokenizer = ByteTokenizer()
        self.vocab_size = cfg.vocab_size
        self.context_length = cfg.max_position_embeddings
        self.precision = precision
        self.kv_cache_dtype = kv_cache_dtype
        self.kernel = self.config.kernel_dtype
        self.eos_token_id = self.tokenizer.eos_id
        self._kv = KVPool(num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                          head_dim=cfg.head_dim, max_context=cfg.max_position_embeddings,
                          kv_dtype=kv_cache_dtype, device=device)
        self._lock = threading.RLock()            # held for a whole step and by control calls
        self._inbox_lock = threading.Lock()
        self._inbox: list[_Running] = []
        self._live: set[str] = set()
        self._waiting: deque[_Running] = deque()
        self._running: list[_Running] = []        # index == KV slot
        self._sessions: OrderedDict[str, SessionKV] = OrderedDict()
        self._paused = False
        self._wake = threading.Event()
        self._seed_counter = 0
        self.num_steps = 0

    # ---- properties of the contract ----------------------------------------------------------
    @property
    def weight_version(self) -> str:
        return self._weights.version

    @weight_version.setter
    def weight_version(self, value: str) -> None:
        self.update_weight_version(value)

    @property
    def weights(self) -> Weights:
        """The weights serving now (immutable; a weight update replaces the object)."""
        return self._weights

    @property
    def is_paused(self) -> bool:
        return self._paused

    def _load(self, path: str | Path, version: str | None) -> Weights:
        c = self.config
        return load_weights(path, precision=c.precision, kernel=c.kernel_dtype, version=version,
                            fp8_scaling=c.fp8_scaling, fp8_scaled_mm=c.fp8_scaled_mm, device=c.device,
                            weight_noise=c.weight_noise, noise_seed=c.seed)

    # ---- requests ------------------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> None:
        """Raise ValueError (naming the field and what is allowed) if the engine cannot serve `req`."""
        p = req.params
        ids = req.input_ids
        v = self.vocab_size
        if not isinstance(req.rid, str) or not req.rid:
            raise ValueError(f"rid: must be a non-empty string, got {req.rid!r}")
        if not isinstance(ids, list) or not ids:
            raise ValueError("input_ids: must be a non-empty list of token ids")
        for t in ids:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < v:
                raise ValueError(f"input_ids: token id {t!r} outside the vocabulary [0, {v})")

        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"sampling_params.{name} = {getattr(p, name)!r}; allowed: {allowed}")

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x

        need(is_int(p.max_new_tokens) and p.max_new_tokens >= 0, "max_new_tokens", "an integer >= 0")
        need(is_num(p.temperature) and 0 <= p.temperature < float("inf"), "temperature", "a number >= 0")
        need(valid_top_p(p.top_p), "top_p", TOP_P_ALLOWED)
        need(is_int(p.top_k) and (p.top_k == -1 or p.top_k >= 1), "top_k", "-1 (all) or an integer >= 1")
        need(is_num(p.min_p) and 0 <= p.min_p <= 1, "min_p", "a number in [0, 1]")
        need(is_int(p.min_new_tokens) and p.min_new_tokens >= 0, "min_new_tokens", "an integer >= 0")
        need(p.sampling_seed is None or is_int(p.sampling_seed), "sampling_seed", "an integer or null")
        for t in p.stop_token_ids:
            if not is_int(t) or not 0 <= t < v:
                raise ValueError(f"sampling_params.stop_token_ids: {t!r} outside the vocabulary [0, {v})")
        if not is_int(req.top_logprobs_num) or req.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num = {req.top_logprobs_num!r}; allowed: an integer >= 0")
        if req.return_routed_experts and not self._record_routing:
            raise ValueError("return_routed_experts = true needs the engine started with enable_return_routed_experts "
                             "(`mixfleet serve --enable-return-routed-experts`, a MoE model)")
        lp_start = req.logprob_start_len
        if not is_int(lp_start) or not -1 <= lp_start <= len(ids):
            raise ValueError(f"logprob_start_len = {lp_start!r}; allowed: -1 (no prompt log-probs) or an integer in "
                             f"[0, prompt length {len(ids)}]")
        start = req.routed_experts_start_len
        if not is_int(start) or not 0 <= start <= len(ids):
            raise ValueError(f"routed_experts_start_len = {start!r}; allowed: an integer in [0, prompt length "
                             f"{len(ids)}]")
        total = len(ids) + p.max_new_tokens
        if total > self.context_length:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) = {total} "
                             f"exceeds the context length {self.context_length}")
        if total > self.config.max_total_tokens:
            raise ValueError(f"prompt + max_new_tokens = {total} exceeds the engine's KV-token budget "
                             f"{self.config.max_total_tokens}")
        if req.return_sampling_mask and p.temperature >= GREEDY_TEMPERATURE:
            bound = v if p.top_k == -1 else min(p.top_k, v)
            cap = self.config.sampling_mask_max_tokens
            if bound > cap:
                raise ValueError(f"return_sampling_mask: the kept set could hold {bound} tokens, more than "
                                 f"sampling_mask_max_tokens = {cap}; set sampling_params.top_k <= {cap}")

    def add_request(self, req: EngineRequest, *, on_finish: Callable[[RequestResult], None],
                    on_token: Callable[[TokenOutput], None] | None = None) -> None:
        """Queue a request (any thread). ValueError if it is malformed or cannot fit; nothing changes then."""
        self.validate(req)
        p = req.params
        with self._inbox_lock:
            if req.rid in self._live:
                raise ValueError(f"rid {req.rid!r} is already in use by a running request")
            seed = p.sampling_seed
            if seed is None:
                seed = self.config.seed * 1_000_003 + self._seed_counter
                self._seed_counter += 1
            row = RowParams(temperature=float(p.temperature), top_p=float(p.top_p), top_k=p.top_k,
                            min_p=float(p.min_p), top_logprobs_num=min(req.top_logprobs_num, self.vocab_size),
                            want_mask=req.return_sampling_mask, mask_cap=self.config.sampling_mask_max_tokens)
            self._live.add(req.rid)
            self._inbox.append(_Running(req=req, on_finish=on_finish, on_token=on_token, rng=random.Random(seed),
                                        stop_ids=_stop_ids(p, self.eos_token_id), row=row, t0_s=time.monotonic()))
        self._wake.set()

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            self._waiting.extend(self._inbox)
            self._inbox.clear()

    # ---- finishing -----------------------------------------------------------------------------
    def _finish(self, r: _Running, reason: dict) -> None:
        with self._inbox_lock:
            self._live.discard(r.req.rid)
        routed = None
        if r.req.return_routed_experts:
            rows = self._routing_rows(r)
            routed = rows[min(r.req.routed_experts_start_len, rows.shape[0]):]
        res = RequestResult(rid=r.req.rid, output_ids=list(r.output), tokens=list(r.tokens), finish_reason=reason,
                            prompt_tokens=len(r.req.input_ids), cached_tokens=r.cached_tokens,
                            weight_version=r.tokens[-1].weight_version if r.tokens else self.weight_version,
                            e2e_latency=time.monotonic() - r.t0_s, routed_experts=routed,
                            input_token_logprobs=r.input_lps, input_top_logprobs=r.input_tops)
        try:
            r.on_finish(res)
        except Exception:  # a caller's callback must not take the engine down
            log.exception("on_finish callback of %s failed", r.req.rid)

    def _routing_rows(self, r: _Running) -> torch.Tensor:
        """The experts of the request's forwarded tokens (prompt + output - 1 after a finish), [n, layers, k]."""
        if r.routing:
            return torch.cat(r.routing) if len(r.routing) > 1 else r.routing[0]
        cfg = self._weights.cfg
        return torch.zeros(0, cfg.num_hidden_layers, cfg.num_experts_per_tok, dtype=torch.int32)

    def _remove_running(self, indices: list[int]) -> None:
        """Drop running requests at these slots; the last slot moves into each hole (KV copied)."""
        for i in sorted(set(indices), reverse=True):
            last = len(self._running) - 1
            if i != last:
                self._kv.move(last, i, self._running[last].kv_len)
                self._running[i] = self._running[last]
            self._running.pop()

    def _save_session(self, slot: int, r: _Running, version: str) -> None:
        sid = r.req.session_id
        if sid is None or self.config.max_cached_sessions == 0 or r.kv_len == 0:
            return
        tokens = (list(r.req.input_ids) + r.output)[: r.kv_len]
        self._sessions[sid] = self._kv.export(slot, tokens, version)
        if self._record_routing:
            rows = self._routing_rows(r)
            r.routing = [rows]
            self._sessions[sid].routed_experts = rows[: r.kv_len]
        self._sessions.move_to_end(sid)
        cap_tokens = self.config.max_total_tokens      # cached KV is bounded like the running KV
        while (len(self._sessions) > self.config.max_cached_sessions
               or sum(len(x.tokens) for x in self._sessions.values()) > cap_tokens):
            self._sessions.popitem(last=False)

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Finish the named (or all) requests now: finish_reason abort, partial tokens. Returns how many.

        Runs on the caller's thread (after any step in progress), so on_finish may run there."""
        with self._lock:
            self._drain_inbox()
            n = 0
            keep: deque[_Running] = deque()
            for r in self._waiting:
                if abort_all or r.req.rid == rid:
                    self._finish(r, {"type": "abort", "message": "Abort before prefill" if not r.output
                                     else "Aborted"})
                    n += 1
                else:
                    keep.append(r)
            self._waiting = keep
            hit = [i for i, r in enumerate(self._running) if abort_all or r.req.rid == rid]
            done = [self._running[i] for i in hit]
            self._remove_running(hit)
            for r in done:
                self._finish(r, {"type": "abort", "message": "Aborted"})
            return n + len(done)

    # ---- control -------------------------------------------------------------------------------
    def pause(self, mode: str = "in_place") -> None:
        """Stop stepping. in_place: keep requests and KV; abort: abort all; retract: running requests
        go back to the front of the queue without their KV (re-prefilled, prompt + output, on resume)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}; allowed: {', '.join(PAUSE_MODES)}")
        with self._lock:
            self._paused = True
            if mode == "abort":
                self.abort(abort_all=True)
            elif mode == "retract":
                back = list(self._running)
                self._running.clear()
                for r in reversed(back):
                    r.kv_len = 0
                    r.routing = []
                    self._waiting.appendleft(r)

    def resume(self) -> None:
        with self._lock:
            self._paused = False
        self._wake.set()

    def update_weights_from_disk(self, model_path: str | Path, weight_version: str | None = None) -> tuple[bool, str]:
        """Load + requantize (on the caller's thread), then swap in between two steps. Running requests
        continue on the new weights; session prefix caches are dropped (their KV came from old weights).
        weight_version None: the checkpoint's `mixfleet_weight_version`. A failed load changes nothing."""
        try:
            new = self._load(model_path, None if weight_version is None else str(weight_version))
        except Exception as e:  # missing folder, bad shapes, unreadable file...
            return False, f"failed to load weights from {model_path}: {e}"
        diff = same_architecture(self._weights.cfg, new.cfg)
        if diff is not None:
            return False, f"failed to load weights from {model_path}: architecture differs ({diff})"
        with self._lock:
            self._weights = new
            self.model_path = str(model_path)
            self._sessions.clear()
        return True, f"Succeeded to update model weights (weight_version {new.version})."

    def update_weight_version(self, new_version: str) -> None:
        """Rename the serving weights' version (SGLang's /update_weight_version)."""
        with self._lock:
            w = self._weights
            self._weights = dataclasses.replace(w, version=str(new_version))

    def flush_cache(self) -> bool:
        """Drop the session prefix caches; False (nothing done) while requests are running or waiting."""
        with self._lock:
            self._drain_inbox()
            if self._running or self._waiting:
                return False
            self._sessions.clear()
            return True

    def load(self) -> dict:
        running = list(self._running)
        used = sum(r.kv_len for r in running)
        budget = self.config.max_total_tokens
        return {"num_running_reqs": len(running), "num_waiting_reqs": len(self._waiting) + len(self._inbox),
                "num_used_tokens": used, "max_total_num_tokens": budget, "token_usage": used / budget}

    def server_info(self) -> dict:
        """The launch settings (for /server_info)."""
        c = self.config
        return {"model_path": self.model_path, "precision": c.precision, "quantization": c.precision,
                "kv_cache_dtype": c.kv_cache_dtype, "kernel": c.kernel_dtype,
                "max_total_num_tokens": c.max_total_tokens,
                "max_running_requests": c.max_running_requests, "sampling_mask_max_tokens": c.sampling_mask_max_tokens,
                "context_length": self.context_length, "vocab_size": self.vocab_size, "device": c.device,
                "fp8_scaling": c.fp8_scaling, "fp8_scaled_mm": c.fp8_scaled_mm, "weight_noise": c.weight_noise,
                "enable_return_routed_experts": c.enable_return_routed_experts,
                "tp_size": 1,
                "weight_version": self.weight_version}

    # ---- the loop --------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit + prefill what fits, then one decode step for the batch. True if it did work."""
        with self._lock, torch.inference_mode():
            self._drain_inbox()
            if self._paused:
                return False
            w = self._weights                      # one weight version for the whole step
            admitted = self._admit(w)
            decoded = self._decode(w)
            if admitted or decoded:
                self.num_steps += 1
            return bool(admitted or decoded)

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                did = self.step()
            except Exception:
                log.exception("engine step failed; aborting the running requests")
                self.abort(abort_all=True)
                did = False
            if not did:
                self._wake.wait(0.01)
                self._wake.clear()

    def _admit(self, w: Weights) -> int:
        """Admit waiting requests (FIFO) while the batch and the KV-token budget allow; prefill them
        together (reusing a session's cached prefix) and sample each one's first token."""
        reserved = sum(r.reserved_tokens for r in self._running)
        admitted: list[_Running] = []
        items: list[tuple[int, list[int], int]] = []
        while self._waiting:
            r = self._waiting[0]
            if r.req.params.max_new_tokens == 0 and not r.wants_input_logprobs:
                self._waiting.popleft()
                self._finish(r, {"type": "length", "length": 0})
                continue
            if len(self._running) >= self.config.max_running_requests:
                break
            if reserved + r.reserved_tokens > self.config.max_total_tokens:
                break
            self._waiting.popleft()
            reserved += r.reserved_tokens
            slot = len(self._running)
            self._kv.ensure(slot + 1, r.reserved_tokens)
            self._running.append(r)
            ids = list(r.req.input_ids) + r.output      # output non-empty after a retract
            start = 0
            sess = self._sessions.get(r.req.session_id) if r.req.session_id is not None and not r.output else None
            if sess is not None:
                common = 0
                for a, b in zip(sess.tokens, ids, strict=False):
                    if a != b:
                        break
                    common += 1
                start = min(common, len(ids) - 1)
                if r.wants_input_logprobs:     # the prompt's positions from logprob_start_len on are forwarded
                    start = min(start, r.req.logprob_start_len)
                if start > 0:
                    self._kv.import_(slot, sess, start)
                    r.cached_tokens = start
                    if self._record_routing and sess.routed_experts is not None:
                        r.routing = [sess.routed_experts[:start]]
            items.append((slot, ids[start:], start))
            r.kv_len = len(ids)
            admitted.append(r)
        if admitted:
            routing: list[torch.Tensor] | None = [] if self._record_routing else None
            scoring = any(r.wants_input_logprobs for r in admitted)
            hidden: list[torch.Tensor] | None = [] if scoring else None
            logits = prefill_many(w, self._kv, items, routing=routing, hidden_out=hidden)
            if routing:
                for r, chunk in zip(admitted, routing[0].split([len(ids) for _, ids, _ in items]), strict=True):
                    r.routing.append(chunk)
            if hidden:
                self._input_logprobs(w, admitted, items, hidden[0])
            self._finish_scored(w, admitted)     # max_new_tokens 0: scored only, nothing to sample
            keep = [i for i, r in enumerate(admitted) if r.req.params.max_new_tokens > 0]
            if keep:
                batch = [admitted[i] for i in keep]
                self._sample_and_emit(w, batch, logits if len(keep) == len(admitted) else logits[keep])
        return len(admitted)

    def _input_logprobs(self, w: Weights, admitted: list[_Running], items: list[tuple[int, list[int], int]],
                        hidden: torch.Tensor) -> None:
        """Prompt log-probs of the admitted requests that asked (logprob_start_len = k >= 0), from this prefill's
        hidden states (the prefix reuse was capped at k, so positions k..T-2 were forwarded): SGLang's shape, one
        entry per position k..T-1, the first None (its predicting position is not scored), entry i the
        log-prob of token k+i given the tokens before it."""
        off = 0
        for r, (_slot, ids, start) in zip(admitted, items, strict=True):
            n = len(ids)
            if r.wants_input_logprobs:
                prompt = r.req.input_ids
                k = r.req.logprob_start_len
                rows = hidden[off + (k - start): off + (len(prompt) - 1 - start)]      # positions k..T-2
                lps, tops = position_logprobs(w, rows, prompt[k + 1:], r.req.top_logprobs_num)
                r.input_lps = [None, *lps]
                r.input_tops = [None, *tops] if r.req.top_logprobs_num > 0 else None
            off += n

    def _finish_scored(self, w: Weights, admitted: list[_Running]) -> None:
        done = [r for r in admitted if r.req.params.max_new_tokens == 0]
        if not done:
            return
        slots = {id(r): i for i, r in enumerate(self._running)}
        for r in done:
            self._save_session(slots[id(r)], r, w.version)
        self._remove_running([slots[id(r)] for r in done])
        for r in done:
            self._finish(r, {"type": "length", "length": 0})

    def _decode(self, w: Weights) -> int:
        """One batched decode step for every running request (those admitted this step included)."""
        if not self._running:
            return 0
        batch = list(self._running)
        ids = [r.output[-1] for r in batch]
        positions = [r.kv_len for r in batch]
        routing: list[torch.Tensor] | None = [] if self._record_routing else None
        logits = decode(w, self._kv, ids, positions, routing=routing)
        for i, r in enumerate(batch):
            r.kv_len += 1
            if routing:
                r.routing.append(routing[0][i:i + 1])
        self._sample_and_emit(w, batch, logits)
        return len(batch)

    def _sample_and_emit(self, w: Weights, batch: list[_Running], logits: torch.Tensor) -> None:
        """Sample a token for each request of `batch` (batch[i] is slot i unless it was just admitted),
        record it, and finish the requests that stop."""
        for i, r in enumerate(batch):
            if len(r.output) < r.req.params.min_new_tokens and r.stop_ids:
                logits[i, list(r.stop_ids)] = float("-inf")
        samples = sample_batch(logits, [r.row for r in batch], [r.rng for r in batch])
        finished: list[tuple[_Running, dict]] = []
        for r, s in zip(batch, samples, strict=True):
            tok = TokenOutput(token_id=s.token_id, logprob=s.logprob,
                              top_logprobs=s.top_logprobs if r.req.top_logprobs_num > 0 else [],
                              mask_ids=s.mask_ids, mask_logprobs=s.mask_logprobs, weight_version=w.version)
            r.output.append(s.token_id)
            r.tokens.append(tok)
            if r.on_token is not None:
                try:
                    r.on_token(tok)
                except Exception:
                    log.exception("on_token callback of %s failed", r.req.rid)
            if s.token_id in r.stop_ids:
                finished.append((r, {"type": "stop", "matched": s.token_id}))
            elif len(r.output) >= r.req.params.max_new_tokens:
                finished.append((r, {"type": "length", "length": len(r.output)}))
        if not finished:
            return
        slots = {id(r): i for i, r in enumerate(self._running)}
        for r, _ in finished:
            self._save_session(slots[id(r)], r, w.version)
        self._remove_running([slots[id(r)] for r, _ in finished])
        for r, reason in finished:
            self._finish(r, reason)
