"""The embedded sampler's HTTP server: a `SamplerEngine` behind SGLang's native API subset.

FastAPI app (`create_app`) + uvicorn (`serve`), bound to 127.0.0.1 by default. The engine runs on
one background thread (`engine.run_forever`); HTTP handlers run on the asyncio loop. Engine
callbacks (on the engine thread) hand tokens and results to the loop with
`loop.call_soon_threadsafe`, so a handler simply awaits its request's future (or reads its queue
when streaming). Parsing and validation live in `runner/sampler/protocol.py`: a malformed request is
answered 400 before the engine sees it, so it never disturbs the requests in flight.

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

Browsers (`check_browser_request`, with or without a key): a web page must not drive a local sampler, so a
server bound to a loopback address answers only a loopback Host (localhost, *.localhost, 127.x.x.x, [::1]:
a DNS-rebinding name is refused), every request that says it comes from another origin (an `Origin` that is
not the request's own, `Sec-Fetch-Site: cross-site` / `same-site`) is refused with 403, and a POST / PUT
body must be JSON (`Content-Type` application/json, or none): the content types a page may send without a
CORS preflight (text/plain, forms) get a 400, as real SGLang's FastAPI handlers refuse non-JSON bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import math
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from mixfleet.costmodel.jsonsafe import json_safe
from mixfleet.costmodel.specs.formats import formats
from mixfleet.runner.checkpoint.tokenizer import ByteTokenizer
from mixfleet.runner.sampler.engine_api import EngineRequest, RequestResult, SamplerEngine, SamplingParams, TokenOutput
from mixfleet.runner.sampler.protocol import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_SAMPLING_MASK_MAX_TOKENS,
    GenerateCall,
    GenerateItem,
    ProtocolError,
    ProtocolLimits,
    build_response,
    parse_generate,
    parse_json_body,
    response_dict,
)
from starlette.datastructures import Headers

log = logging.getLogger("mixfleet.server")

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
AUTH_HEADER = "Authorization"                  # SGLang's --api-key: "Authorization: Bearer <key>"
AUTH_EXEMPT_PREFIXES = ("/health",)            # as SGLang: /health and /health_generate need no key
MIN_API_KEY_CHARS = 16
PAUSE_MODES = ("abort", "retract", "in_place")
# what SGLang's --quantization calls each embedded precision (None: unquantized; data/precisions.toml)
QUANTIZATION_NAME = {p: formats().sglang_quantization.get(p) for p in formats().engine_precisions}
HEALTH_GENERATE_TIMEOUT_S = 30.0
ENGINE_JOIN_TIMEOUT_S = 10.0
DISCONNECT_POLL_S = 0.5
DEFAULT_HEADER_TIMEOUT_S = 10.0      # a connection must finish each request's headers within this (slow-loris)
DEFAULT_LIMIT_CONCURRENCY = 4096     # open connections + running requests above this get 503 (uvicorn's bound)
NOT_SUPPORTED = "not supported by the embedded engine; use update_weights_from_disk"
CROSS_SITE_FETCH = ("cross-site", "same-site")  # Sec-Fetch-Site values of a request from another page's origin
JSON_CONTENT_TYPES = ("application/json",)      # and application/*+json; no Content-Type at all is fine too


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


def is_loopback_host(host: str) -> bool:
    """A host name or address only this machine reaches: localhost, *.localhost (RFC 6761), 127.0.0.0/8, ::1."""
    name = host.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _split_host(value: str) -> str:
    """The host part of a Host header value ("127.0.0.1:30000", "[::1]:30000", "localhost")."""
    value = value.strip()
    if value.startswith("["):
        return value[: value.find("]") + 1] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def check_browser_request(method: str, headers: Any, bind_host: str) -> tuple[int, str] | None:
    """(status, message) when a request must be refused as one a web page made (see the module doc), else None.

    `headers`: the request's headers (case-insensitive mapping); `bind_host`: the address the server is bound to
    (a loopback one turns the Host check on)."""
    host = headers.get("host")
    if host is not None and is_loopback_host(bind_host) and not is_loopback_host(_split_host(host)):
        return 403, (f"Host header {host[:100]!r} is not a loopback name: this sampler is bound to {bind_host} and "
                     "answers Host localhost, *.localhost, 127.x.x.x or [::1] only (a DNS-rebinding guard); start it "
                     "with --host to serve it under another name")
    origin = headers.get("origin")
    if origin is not None:
        own = {f"{scheme}://{host}".lower() for scheme in ("http", "https")} if host else set()
        if origin.strip().lower().rstrip("/") not in own:
            return 403, (f"Origin {origin[:100]!r} is not this sampler's own origin: requests from web pages of "
                         "another origin are refused (a sampler has no browser clients)")
    fetch_site = headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site.strip().lower() in CROSS_SITE_FETCH:
        return 403, (f"Sec-Fetch-Site = {fetch_site[:40]!r}: requests from web pages of another site are refused "
                     "(allowed: same-origin, none, or no such header)")
    if method in ("POST", "PUT"):
        ctype = headers.get("content-type")
        if ctype is not None:
            media = ctype.split(";", 1)[0].strip().lower()
            if not (media in JSON_CONTENT_TYPES or (media.startswith("application/") and media.endswith("+json"))):
                return 400, (f"Content-Type = {ctype[:80]!r}: a {method} body must be JSON; allowed: "
                             "application/json (or no Content-Type), e.g. curl -H 'Content-Type: application/json'")
    return None


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


class _Pending:
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
        self.pending: dict[str, _Pending] = {}
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
    def submit(self, call: GenerateCall, loop: asyncio.AbstractEventLoop) -> list[_Pending]:
        rids = [it.request.rid for it in call.items]
        busy = [r for r in rids if r in self.pending]
        if busy:
            raise ProtocolError(f"rid {busy[0]!r} is already in flight; request ids must be unique")
        pendings = [_Pending(it, loop, call.stream) for it in call.items]
        added: list[_Pending] = []
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

    def release(self, pendings: list[_Pending], *, abort: bool) -> None:
        for p in pendings:
            rid = p.item.request.rid
            if abort and not p.future.done():
                with contextlib.suppress(Exception):
                    self.engine.abort(rid)
            if self.pending.get(rid) is p:
                del self.pending[rid]

    def respond(self, p: _Pending, result: RequestResult) -> dict:
        return build_response(p.item, result, self.tokenizer)

    def partial(self, p: _Pending) -> dict:
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

    async def _stream(call: GenerateCall, pendings: list[_Pending]) -> AsyncIterator[bytes]:
        finished = False
        try:
            merged: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, p: _Pending) -> None:
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


class ServerHandle:
    """A server running in this process on a background thread (tests, notebooks, the runner)."""

    def __init__(self, server: Any, thread: threading.Thread, url: str, sampler: EmbeddedSampler) -> None:
        self._server, self._thread, self.url, self.sampler = server, thread, url, sampler

    def stop(self) -> None:
        """Answer the requests in flight (finish_reason abort), then shut the server and engine down."""
        with contextlib.suppress(Exception):
            self.sampler.engine.abort(abort_all=True)
        self._server.should_exit = True
        self._thread.join(ENGINE_JOIN_TIMEOUT_S + 5)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_thread(engine: SamplerEngine, *, server_args: ServerArgs | None = None,
                    startup_timeout_s: float = 30.0) -> ServerHandle:
    """Start uvicorn serving `engine` on a thread and return once it accepts connections.

    `server_args.port = 0` picks a free port; the handle's `url` carries the real one.
    """
    import socket

    import uvicorn

    args = server_args or ServerArgs(port=0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    app = create_app(engine, server_args=args)
    app.state.sampler.port = port
    config = uvicorn.Config(app, log_level=args.log_level, lifespan="on", timeout_graceful_shutdown=5,
                            **_uvicorn_limits(args))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="mixfleet-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the sampler server did not start on {args.host}:{port}")
        time.sleep(0.01)
    return ServerHandle(server, thread, f"http://{args.host}:{port}", app.state.sampler)


def serve(engine: SamplerEngine, *, server_args: ServerArgs) -> None:
    """Serve `engine` in the foreground until interrupted (the `mixfleet serve` command)."""
    import uvicorn

    app = create_app(engine, server_args=server_args)
    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
                timeout_graceful_shutdown=5, **_uvicorn_limits(server_args))


def _uvicorn_limits(args: ServerArgs) -> dict:
    """uvicorn settings bounding what a client can hold: the header-read timeout (our h11 protocol), the
    number of connections + requests (`limit_concurrency`), and the keep-alive idle timeout (uvicorn's)."""
    return {"http": header_timeout_protocol(float(args.header_timeout_s)), "limit_concurrency": args.limit_concurrency,
            "timeout_keep_alive": 5}


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a header-read timeout. uvicorn has none: its keep-alive timer stops at a
    connection's first byte, so a client that sends a request's headers a byte at a time (slow-loris) held
    its socket for ever. Here a timer starts when a connection opens and whenever bytes arrive while no
    request is in progress; if the request's headers are not complete `timeout_s` later, the connection is
    closed. A request whose headers have arrived is not timed (its body and its response may take long)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        header_timeout_s = timeout_s

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            self._header_cycle: Any = None
            super().connection_made(transport)
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._header_cycle = self.cycle          # the request (if any) that was in place when the wait began
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._idle():
                self._arm_header_timer()
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self._header_timer is not None and self.cycle is not self._header_cycle:
                self._cancel_header_timer()          # a new request's headers arrived in time

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self.cycle is self._header_cycle and not self.transport.is_closing():
                log.info("closing a connection from %s: request headers not received within %.1f s",
                         self.client, self.header_timeout_s)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol
