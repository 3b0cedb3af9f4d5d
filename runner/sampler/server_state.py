"""The embedded sampler server's state: the engine, its thread, the requests in flight (`EmbeddedSampler`).

The engine runs on one background thread (`engine.run_forever`); HTTP handlers run on the asyncio loop.
Engine callbacks (on the engine thread) hand tokens and results to the loop with
`loop.call_soon_threadsafe` (`Pending`), so a handler simply awaits its request's future (or reads its
queue when streaming). Also what /model_info and /server_info report. The routes that drive this state
are in runner/sampler/server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mixfleet.costmodel.specs.formats import formats
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.engine_api import EngineRequest, RequestResult, SamplerEngine, TokenOutput
from mixfleet.runner.sampler.protocol import GenerateCall, GenerateItem, ProtocolError, ProtocolLimits
from mixfleet.runner.sampler.protocol_response import build_response, response_dict

if TYPE_CHECKING:
    from mixfleet.runner.sampler.server import ServerArgs

log = logging.getLogger("mixfleet.server")

# what SGLang's --quantization calls each embedded precision (None: unquantized; data/precisions.toml)
QUANTIZATION_NAME = {p: formats().sglang_quantization.get(p) for p in formats().engine_precisions}
ENGINE_JOIN_TIMEOUT_S = 10.0


class Pending:
    """One request in flight: the loop-side end of the engine's callbacks."""

    def __init__(self, item: GenerateItem, loop: asyncio.AbstractEventLoop, stream: bool) -> None:
        self.item = item
        self.loop = loop
        self.future: asyncio.Future[RequestResult] = loop.create_future()
        self.queue: asyncio.Queue | None = asyncio.Queue() if stream else None
        self.tokens: list[TokenOutput] = []
        self.start_s = time.perf_counter()

    # engine thread -> loop
    def on_token(self, tok: TokenOutput) -> None:
        if self.queue is not None:
            self._post(self.queue.put_nowait, ("token", tok))

    def on_finish(self, result: RequestResult) -> None:
        self._post(self._finish, result)

    def _post(self, fn: Any, arg: Any) -> None:
        with contextlib.suppress(RuntimeError):       # the loop is closed: the server is shutting down
            self.loop.call_soon_threadsafe(fn, arg)

    def _finish(self, result: RequestResult) -> None:
        if not self.future.done():
            self.future.set_result(result)
        if self.queue is not None:
            self.queue.put_nowait(("finish", result))


class EmbeddedSampler:
    """The server's state: the engine, its thread, the requests in flight."""

    def __init__(self, engine: SamplerEngine, args: ServerArgs, tokenizer: ByteTokenizer | None = None) -> None:
        self.engine = engine
        self.args = args
        self.tokenizer = tokenizer or _tokenizer_for(engine)
        self.limits = ProtocolLimits(vocab_size=engine.vocab_size, context_length=engine.context_length,
                                     max_body_bytes=args.max_body_bytes,
                                     sampling_mask_max_tokens=args.sampling_mask_max_tokens,
                                     max_batch_size=args.max_batch_size,
                                     enable_return_routed_experts=bool(getattr(getattr(engine, "config", None),
                                                                               "enable_return_routed_experts", False)))
        self.pending: dict[str, Pending] = {}
        self.paused = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._engine_error: BaseException | None = None
        self._weights_lock = asyncio.Lock()
        self.port = args.port

    # ---- engine thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="mixfleet-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.engine.run_forever(self._stop)
        except BaseException as e:  # noqa: BLE001 - reported by /health
            self._engine_error = e
            log.exception("engine thread died")

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self.engine.abort(abort_all=True)
        if self._thread is not None:
            self._thread.join(ENGINE_JOIN_TIMEOUT_S)

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._engine_error is None

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, call: GenerateCall, loop: asyncio.AbstractEventLoop) -> list[Pending]:
        rids = [it.request.rid for it in call.items]
        busy = [r for r in rids if r in self.pending]
        if busy:
            raise ProtocolError(f"rid {busy[0]!r} is already in flight; request ids must be unique")
        pendings = [Pending(it, loop, call.stream) for it in call.items]
        added: list[Pending] = []
        try:
            for p in pendings:
                self.pending[p.item.request.rid] = p
                req = p.item.request
                if req.params.max_new_tokens == 0 and not (req.return_logprob
                                                           and 0 <= req.logprob_start_len < len(req.input_ids)):
                    p.on_finish(self._empty_result(req))     # nothing to compute (a scoring request is forwarded)
                else:
                    self.engine.add_request(p.item.request, on_finish=p.on_finish,
                                            on_token=p.on_token if call.stream else None)
                added.append(p)
        except ValueError as e:   # the engine refused the request (e.g. larger than its KV budget)
            for p in pendings:
                self.pending.pop(p.item.request.rid, None)
            for p in added:
                with contextlib.suppress(Exception):
                    self.engine.abort(p.item.request.rid)
            raise ProtocolError(str(e)) from None
        return pendings

    def _empty_result(self, req: EngineRequest) -> RequestResult:
        return RequestResult(rid=req.rid, output_ids=[], tokens=[], finish_reason={"type": "length", "length": 0},
                             prompt_tokens=len(req.input_ids), cached_tokens=0,
                             weight_version=str(self.engine.weight_version), e2e_latency=0.0)

    def release(self, pendings: list[Pending], *, abort: bool) -> None:
        for p in pendings:
            rid = p.item.request.rid
            if abort and not p.future.done():
                with contextlib.suppress(Exception):
                    self.engine.abort(rid)
            if self.pending.get(rid) is p:
                del self.pending[rid]

    def respond(self, p: Pending, result: RequestResult) -> dict:
        return build_response(p.item, result, self.tokenizer)

    def partial(self, p: Pending) -> dict:
        toks = p.tokens
        version = toks[-1].weight_version if toks else str(self.engine.weight_version)
        return response_dict(p.item, output_ids=[t.token_id for t in toks], tokens=toks, finish_reason=None,
                             prompt_tokens=len(p.item.request.input_ids), cached_tokens=0, weight_version=version,
                             e2e_latency=time.perf_counter() - p.start_s, tokenizer=self.tokenizer)

    # ---- info -------------------------------------------------------------------------------
    def model_info(self) -> dict:
        e = self.engine
        return {"model_path": str(e.model_path), "tokenizer_path": str(e.model_path), "is_generation": True,
                "preferred_sampling_params": None, "weight_version": str(e.weight_version),
                "has_image_understanding": False, "has_audio_understanding": False,
                **_model_type(e),
                "vocab_size": e.vocab_size, "context_length": e.context_length}

    def server_info(self) -> dict:
        e = self.engine
        own = getattr(e, "server_info", None)
        info = dict(own()) if callable(own) else {}
        info |= {"model_path": str(e.model_path), "host": self.args.host, "port": self.port,
                "tp_size": self.args.tp_size, "quantization": QUANTIZATION_NAME.get(e.precision, e.precision),
                "kv_cache_dtype": "auto" if e.kv_cache_dtype in ("bf16", "fp32") else e.kv_cache_dtype,
                "dtype": "float32" if e.precision == "fp32" else "bfloat16",
                "context_length": e.context_length, "max_running_requests":
                    self.args.max_running_requests or info.get("max_running_requests"),
                "sampling_mask_max_tokens": self.args.sampling_mask_max_tokens,
                "weight_version": str(e.weight_version), "version": "mixfleet-embedded",
                "mixfleet": {"engine": "embedded", "precision": e.precision, "kv_cache_dtype": e.kv_cache_dtype,
                             "kernel": self.args.kernel or getattr(e, "kernel", None),
                             "server_args": {k: v for k, v in asdict(self.args).items() if k != "api_key"},
                             "api_key_required": self.args.api_key is not None}}
        return info


def _model_type(engine: SamplerEngine) -> dict:
    """model_type / architectures of the served checkpoint's config.json (as SGLang's /get_model_info)."""
    cfg = getattr(getattr(engine, "weights", None), "cfg", None)
    if cfg is None:
        return {"model_type": "mixfleet", "architectures": ["MixfleetForCausalLM"]}
    return {"model_type": cfg.model_type, "architectures": cfg.to_json()["architectures"]}


def _tokenizer_for(engine: SamplerEngine) -> ByteTokenizer:
    tok = getattr(engine, "tokenizer", None)
    if isinstance(tok, ByteTokenizer):
        return tok
    with contextlib.suppress(FileNotFoundError, ValueError, OSError, TypeError):
        return ByteTokenizer.load(Path(engine.model_path))
    return ByteTokenizer()
