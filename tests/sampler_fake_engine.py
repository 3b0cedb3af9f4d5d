"""A small deterministic stand-in for the sampler engine, for server tests that need exact control.

It implements `runner.engine_api.SamplerEngine` without a model: the next-token logits are a
fixed function of (previous token, position, weight version), so outputs are reproducible and
known in advance. Used where a test must hold a request mid-generation at will (`hold`), which
the real engine cannot do on demand; the protocol tests themselves run against the real Engine.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

from mixfleet.runner.engine_api import EngineRequest, RequestResult, TokenOutput

EOS_ID = 2


class FakeEngine:
    def __init__(self, *, vocab_size: int = 272, context_length: int = 128, model_path: str = "/fake") -> None:
        self.vocab_size, self.context_length, self.model_path = vocab_size, context_length, model_path
        self.weight_version, self.precision, self.kv_cache_dtype = "0", "fp32", "fp32"
        self._lock = threading.Condition()
        self._waiting: list[tuple] = []
        self._running: list[dict] = []
        self._abort: set[str] = set()
        self._abort_all = False
        self._paused = False
        self.hold = threading.Event()   # set: no decode steps (requests stay in flight)

    def logprobs(self, prev: int, pos: int) -> list[float]:
        shift = int(self.weight_version) if self.weight_version.isdigit() else 0
        logits = [math.sin(0.37 * j + 1.3 * prev + 0.11 * pos + shift) * 3.0 for j in range(self.vocab_size)]
        m = max(logits)
        z = math.log(sum(math.exp(x - m) for x in logits)) + m
        return [x - z for x in logits]

    def add_request(self, req: EngineRequest, *, on_finish, on_token=None) -> None:
        with self._lock:
            self._waiting.append((req, on_finish, on_token, time.perf_counter()))
            self._lock.notify_all()

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        with self._lock:
            ids = {r["req"].rid for r in self._running} | {w[0].rid for w in self._waiting}
            hit = ids if abort_all else ({rid} & ids)
            self._abort |= hit
            self._lock.notify_all()
            return len(hit)

    def _finish(self, r: dict, reason: dict) -> None:
        r["on_finish"](RequestResult(rid=r["req"].rid, output_ids=[t.token_id for t in r["toks"]], tokens=r["toks"],
                                     finish_reason=reason, prompt_tokens=len(r["req"].input_ids), cached_tokens=0,
                                     weight_version=r["toks"][-1].weight_version if r["toks"] else self.weight_version,
                                     e2e_latency=time.perf_counter() - r["t0"]))

    def step(self) -> bool:
        with self._lock:
            for req, fin, tok, t0 in self._waiting:
                self._running.append({"req": req, "on_finish": fin, "on_token": tok, "toks": [], "t0": t0})
            self._waiting.clear()
            for r in [r for r in self._running if r["req"].rid in self._abort]:
                self._running.remove(r)
                self._finish(r, {"type": "abort", "message": "aborted"})
            self._abort.clear()
            if self._paused or self.hold.is_set() or not self._running:
                return False
            for r in list(self._running):
                req, toks = r["req"], r["toks"]
                seq = req.input_ids + [t.token_id for t in toks]
                lps = self.logprobs(seq[-1], len(seq))
                order = sorted(range(self.vocab_size), key=lambda j: -lps[j])
                tid = order[0]
                k = req.params.top_k if req.params.top_k > 0 else self.vocab_size
                mask = order[:k]
                lz = math.log(sum(math.exp(lps[j]) for j in mask))
                t = TokenOutput(token_id=tid, logprob=lps[tid],
                                top_logprobs=[(lps[j], j) for j in order[:req.top_logprobs_num]],
                                mask_ids=mask if req.return_sampling_mask else None,
                                mask_logprobs=[lps[j] - lz for j in mask] if req.return_sampling_mask else None,
                                weight_version=self.weight_version)
                toks.append(t)
                if r["on_token"]:
                    r["on_token"](t)
                stops = set(req.params.stop_token_ids) | ({EOS_ID} if not req.params.ignore_eos else set())
                if tid in stops:
                    self._running.remove(r)
                    self._finish(r, {"type": "stop", "matched": tid})
                elif len(toks) >= req.params.max_new_tokens:
                    self._running.remove(r)
                    self._finish(r, {"type": "length", "length": len(toks)})
            return True

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.step():
                with self._lock:
                    self._lock.wait(0.005)

    def update_weights_from_disk(self, model_path, weight_version=None) -> tuple[bool, str]:
        cfg = Path(model_path) / "config.json"
        if not cfg.exists():
            return False, f"{model_path}: no config.json"
        with self._lock:
            self.model_path = str(model_path)
            self.weight_version = weight_version or str(json.loads(cfg.read_text()).get("mixfleet_weight_version"))
        return True, "ok"

    def pause(self, mode: str = "in_place") -> None:
        if mode == "abort":
            self.abort(abort_all=True)
        with self._lock:
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._lock.notify_all()

    def load(self) -> dict:
        with self._lock:
            used = sum(len(r["req"].input_ids) + len(r["toks"]) for r in self._running)
            return {"num_running_reqs": len(self._running), "num_waiting_reqs": len(self._waiting),
                    "num_used_tokens": used, "max_total_num_tokens": 4096, "token_usage": used / 4096}
