"""The embedded sampler's HTTP server: a `SamplerEngine` behind SGLang's native API subset.

FastAPI app (`create_app`: the routes and middleware) and its launch settings (`ServerArgs`), bound to
127.0.0.1 by default. Parsing and validation live in `runner/sampler/protocol.py`: a malformed request is
answered 400 before the engine sees it, so it never disturbs the requests in flight. The server's state (the
engine on its background thread, the requests in flight handed between the engine thread and the asyncio loop)
is `EmbeddedSampler` in `runner/sampler/server_state.py`; running the app under uvicorn (`serve`,
`start_in_thread`, the header-read timeout) is `runner/sampler/server_launch.py`.

Endpoints: /generate (single, batch, `stream` as server-sent events), /health, /health_generate,
/model_info, /server_info, /weight_version (each also under its /get_ name), /get_load,
/flush_cache, /abort_request, /pause_generation, /continue_generation, /update_weights_from_disk,
/update_weight_version. The distributed weight-update endpoints answer 400: the embedded engine
takes weights from disk.

API key (`ServerArgs.api_key`, `mixfleet serve --api-key`): as real SGLang's `--api-key`
(sglang/srt/utils `add_api_key_middleware`), every request must carry `Authorization: Bearer <key>`,
except the health checks (paths starting with /health) and CORS preflights (OPTIONS); anything else is
answered 401 with a message. A real run starts every replica with its own run's key
(runner/orchestration), so a sampler port reachable on a cluster network does not serve strangers.

Browsers (with or without a key): a web page must not drive a local sampler; `BrowserGuard` refuses what
`check_browser_request` (runner/sampler/browser_guard.py, which states the rules) refuses: a non-loopback Host
on a loopback-bound server, another origin (403), a non-JSON POST / PUT body (400).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from mixfleet.costmodel.jsonsafe import json_safe
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.browser_guard import check_browser_request
from mixfleet.runner.sampler.engine_api import EngineRequest, RequestResult, SamplerEngine, SamplingParams
from mixfleet.runner.sampler.protocol import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_SAMPLING_MASK_MAX_TOKENS,
    GenerateCall,
    ProtocolError,
    parse_generate,
    parse_json_body,
)
from mixfleet.runner.sampler.server_state import EmbeddedSampler, Pending
from starlette.datastructures import Headers

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
AUTH_HEADER = "Authorization"                  # SGLang's --api-key: "Authorization: Bearer <key>"
AUTH_EXEMPT_PREFIXES = ("/health",)            # as SGLang: /health and /health_generate need no key
MIN_API_KEY_CHARS = 16
PAUSE_MODES = ("abort", "retract", "in_place")
HEALTH_GENERATE_TIMEOUT_S = 30.0
DISCONNECT_POLL_S = 0.5
DEFAULT_HEADER_TIMEOUT_S = 10.0      # a connection must finish each request's headers within this (slow-loris)
DEFAULT_LIMIT_CONCURRENCY = 4096     # open connections + running requests above this get 503 (uvicorn's bound)
NOT_SUPPORTED = "not supported by the embedded engine; use update_weights_from_disk"


@dataclass(frozen=True, kw_only=True)
class ServerArgs:
    """Launch settings of one embedded sampler server (also reported by /server_info)."""

    host: str = "127.0.0.1"                      # bind address; loopback unless told otherwise
    port: int = 30000
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get a 400
    sampling_mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS  # largest kept set per token
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE  # prompts per /generate call
    max_running_requests: int | None = None      # engine's batch bound (reported; the engine enforces it)
    kernel: str | None = None                     # matmul dtype after dequantization (reported)
    tp_size: int = 1                              # always 1 for the embedded engine
    log_level: str = "warning"                    # uvicorn's log level
    api_key: str | None = field(default=None, repr=False)  # required as "Authorization: Bearer <key>"; never shown
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S  # seconds to receive a request's headers, else disconnected
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY  # uvicorn's limit_concurrency (503 above it)

    def __post_init__(self) -> None:
        if self.api_key is not None and (not isinstance(self.api_key, str) or len(self.api_key) < MIN_API_KEY_CHARS
                                         or any(c.isspace() for c in self.api_key)):
            raise ValueError(f"ServerArgs.api_key: must be a string of >= {MIN_API_KEY_CHARS} characters without "
                             "spaces, or None (no key)")
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"ServerArgs.host = {self.host!r}: must be a host name or address")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"ServerArgs.port = {self.port!r}: allowed 0..65535 (0: any free port)")
        t = self.header_timeout_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.1 <= t <= 3600:
            raise ValueError(f"ServerArgs.header_timeout_s = {t!r}: allowed a number of seconds in [0.1, 3600]")
        for name in ("max_body_bytes", "sampling_mask_max_tokens", "max_batch_size", "tp_size", "limit_concurrency"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ServerArgs.{name} = {v!r}: must be an integer >= 1")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"ServerArgs.max_running_requests = {self.max_running_requests}: must be >= 1 or None")
        if self.tp_size != 1:
            raise ValueError(f"ServerArgs.tp_size = {self.tp_size}: the embedded engine runs tp_size 1")
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        if self.log_level not in levels:
            raise ValueError(f"ServerArgs.log_level = {self.log_level!r}: allowed {', '.join(levels)}")


class BrowserGuard:
    """Plain ASGI middleware refusing what `check_browser_request` refuses. Not Starlette's BaseHTTPMiddleware:
    that one hides a client's disconnect from a streaming response, and a disconnected request must be aborted."""

    def __init__(self, app: Any, *, bind_host: str) -> None:
        self.app, self.bind_host = app, bind_host

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = check_browser_request(scope["method"], Headers(scope=scope), self.bind_host)
            if refused is not None:
                await _error(refused[1], refused[0])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class FiniteJSONResponse(JSONResponse):
    """JSON with NaN / Inf as null: Starlette refuses to render them (a 500) and json.dumps writes invalid JSON."""

    def render(self, content: Any) -> bytes:
        return json.dumps(json_safe(content), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _error(message: str, status: int = 400) -> JSONResponse:
    return FiniteJSONResponse({"error": {"message": message}}, status_code=status)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refused (ProtocolError) as soon as it exceeds max_bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ProtocolError(f"request body is {declared} bytes; the limit is {max_bytes} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ProtocolError(f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _json_object(request: Request, max_bytes: int, allowed: dict[str, tuple[type, ...]]) -> dict:
    """A control endpoint's JSON object body, checked against its allowed keys and types."""
    obj = parse_json_body(await _read_body(request, max_bytes), max_bytes)
    if not isinstance(obj, dict):
        raise ProtocolError(f"the body must be a JSON object; got {type(obj).__name__}")
    for k, v in obj.items():
        if k not in allowed:
            raise ProtocolError(f"{k}: unknown key; allowed: {', '.join(sorted(allowed))}")
        types = allowed[k]
        if v is not None and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)):
            names = " or ".join("boolean" if t is bool else t.__name__ for t in types)
            raise ProtocolError(f"{k} = {json.dumps(v)[:60]}: must be {names}")
    return obj


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(json_safe(obj), allow_nan=False).encode() + b"\n\n"


def create_app(engine: SamplerEngine, *, server_args: ServerArgs | None = None,
               tokenizer: ByteTokenizer | None = None) -> FastAPI:
    """The FastAPI app serving `engine`; the engine thread starts and stops with the app's lifespan."""
    args = server_args or ServerArgs()
    state = EmbeddedSampler(engine, args, tokenizer)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="mixfleet embedded sampler", lifespan=lifespan, docs_url=None, redoc_url=None,
                  default_response_class=FiniteJSONResponse)
    app.state.sampler = state

    if args.api_key is not None:
        expected = f"Bearer {args.api_key}".encode()

        @app.middleware("http")
        async def _require_api_key(request: Request, call_next: Any) -> Response:
            if request.method == "OPTIONS" or request.url.path.startswith(AUTH_EXEMPT_PREFIXES):
                return await call_next(request)
            sent = request.headers.get(AUTH_HEADER)
            if sent is None:
                return _error(f"missing API key: this sampler requires the header '{AUTH_HEADER}: Bearer <key>' "
                              "(started with --api-key)", 401)
            if not secrets.compare_digest(sent.encode(), expected):
                return _error("wrong API key (the header 'Authorization: Bearer <key>' does not match this "
                              "sampler's --api-key)", 401)
            return await call_next(request)

    # added last, so it runs first: a page's request is refused before the key check
    app.add_middleware(BrowserGuard, bind_host=args.host)

    @app.exception_handler(ProtocolError)
    async def _protocol_error(_request: Request, exc: ProtocolError) -> JSONResponse:
        return FiniteJSONResponse(exc.to_json(), status_code=400)

    # ---- generation -------------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        body = await _read_body(request, args.max_body_bytes)
        obj = parse_json_body(body, args.max_body_bytes)
        call = parse_generate(obj, state.limits, state.tokenizer,
                              routing_key=request.headers.get(ROUTING_KEY_HEADER))
        loop = asyncio.get_running_loop()
        pendings = state.submit(call, loop)
        if call.stream:
            return StreamingResponse(_stream(call, pendings), media_type="text/event-stream")
        finished = False
        try:
            futures = [p.future for p in pendings]
            while True:
                _done, waiting = await asyncio.wait(futures, timeout=DISCONNECT_POLL_S)
                if not waiting:
                    break
                if await request.is_disconnected():
                    return Response(status_code=499)
            finished = True
            out = [state.respond(p, p.future.result()) for p in pendings]
        finally:
            state.release(pendings, abort=not finished)
        return FiniteJSONResponse(out if call.is_batch else out[0])

    async def _stream(call: GenerateCall, pendings: list[Pending]) -> AsyncIterator[bytes]:
        finished = False
        try:
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, p: Pending) -> None:
                assert p.queue is not None
                while True:
                    kind, payload = await p.queue.get()
                    await merged.put((i, kind, payload))
                    if kind == "finish":
                        return

            tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(pendings)]
            try:
                left = len(pendings)
                while left:
                    i, kind, payload = await merged.get()
                    p = pendings[i]
                    if kind == "token":
                        p.tokens.append(payload)
                        if len(p.tokens) % p.item.stream_interval:
                            continue
                        out = state.partial(p)
                    else:
                        left -= 1
                        out = state.respond(p, payload)
                    if call.is_batch:
                        out["index"] = i
                    yield _sse(out)
                finished = True
                yield b"data: [DONE]\n\n"
            finally:
                for t in tasks:
                    t.cancel()
        finally:
            state.release(pendings, abort=not finished)

    # ---- health and info --------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.ready else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not state.ready:
            return Response(status_code=503)
        if state.paused:
            return Response(status_code=200)
        req = EngineRequest(rid=f"HEALTH_CHECK_{uuid.uuid4().hex}", input_ids=[state.tokenizer.bos_id],
                            params=SamplingParams(max_new_tokens=1, temperature=0.0))
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(result: RequestResult) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

        engine.add_request(req, on_finish=done)
        try:
            result = await asyncio.wait_for(fut, HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            engine.abort(req.rid)
            return Response(status_code=503)
        if any(not math.isfinite(t.logprob) for t in result.tokens):   # NaN logits sample token 0 "fine"
            return PlainTextResponse("the model's log-probs are not finite", status_code=503)
        return Response(status_code=200)

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, lambda: state.model_info(), methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, lambda: state.server_info(), methods=["GET"])
    for path in ("/weight_version", "/get_weight_version"):
        app.add_api_route(path, lambda: {"weight_version": str(engine.weight_version)}, methods=["GET"])

    @app.get("/get_load")
    async def get_load() -> dict:
        return dict(engine.load())

    # ---- control ----------------------------------------------------------------------------
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        load = engine.load()
        if load.get("num_running_reqs", 0) or load.get("num_waiting_reqs", 0) or state.pending:
            return PlainTextResponse("Cache not flushed: requests are running or waiting.", status_code=400)
        flush = getattr(engine, "flush_cache", None)
        if callable(flush) and flush() is False:
            return PlainTextResponse("Cache not flushed: requests are running or waiting.", status_code=400)
        return PlainTextResponse("Cache flushed.", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> dict:
        obj = await _json_object(request, args.max_body_bytes, {"rid": (str,), "abort_all": (bool,),
                                                               "finished_reason": (dict,), "abort_message": (str,)})
        if obj.get("abort_all"):
            n = await asyncio.to_thread(engine.abort, abort_all=True)
        elif obj.get("rid"):
            n = await asyncio.to_thread(engine.abort, obj["rid"])
        else:
            raise ProtocolError("give `rid` (a request id) or `abort_all: true`")
        return {"success": True, "num_aborted": n}

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> dict:
        obj = await _json_object(request, args.max_body_bytes, {"mode": (str,)})
        mode = obj.get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise ProtocolError(f"mode = {mode!r}: allowed {', '.join(PAUSE_MODES)}")
        await asyncio.to_thread(engine.pause, mode)
        state.paused = True
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: Request) -> dict:
        await _json_object(request, args.max_body_bytes, {})
        await asyncio.to_thread(engine.resume)
        state.paused = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        obj = await _json_object(request, args.max_body_bytes, {
            "model_path": (str,), "weight_version": (str,), "abort_all_requests": (bool,), "load_format": (str,),
            "flush_cache": (bool,), "is_async": (bool,), "torch_empty_cache": (bool,), "keep_pause": (bool,),
            "recapture_cuda_graph": (bool,), "token_step": (int,)})
        if not obj.get("model_path"):
            raise ProtocolError("model_path: required (a checkpoint folder: config.json + *.safetensors)")
        if obj.get("load_format") not in (None, "auto", "safetensors"):
            raise ProtocolError(f"load_format = {obj['load_format']!r}: the embedded engine reads safetensors "
                                "(allowed null, \"auto\", \"safetensors\")")
        async with state._weights_lock:
            if obj.get("abort_all_requests"):
                engine.abort(abort_all=True)
            ok, message = await asyncio.to_thread(engine.update_weights_from_disk, obj["model_path"],
                                                  obj.get("weight_version"))
        body = {"success": bool(ok), "message": message, "num_paused_requests": 0}
        return FiniteJSONResponse(body, status_code=200 if ok else 400)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> dict:
        obj = await _json_object(request, args.max_body_bytes, {"new_version": (str,), "abort_all_requests": (bool,)})
        if not obj.get("new_version"):
            raise ProtocolError("new_version: required (a non-empty string)")
        if obj.get("abort_all_requests"):
            engine.abort(abort_all=True)
        rename = getattr(engine, "update_weight_version", None)
        if callable(rename):
            rename(obj["new_version"])
        else:
            engine.weight_version = obj["new_version"]
        return {"success": True, "new_version": obj["new_version"], "message": "Weight version updated."}

    async def _not_supported() -> JSONResponse:
        return FiniteJSONResponse({"success": False, "message": NOT_SUPPORTED}, status_code=400)

    for path in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
                 "/update_weights_from_tensor"):
        app.add_api_route(path, _not_supported, methods=["POST"])

    return app


