"""Async HTTP client for samplers: the embedded server and real SGLang servers alike.

One `SamplerClient` per sampler replica (base URL). It speaks SGLang's native API subset
(runner/sampler/protocol.py): `generate` (with the session's `X-SMG-Routing-Key` header, so a router keeps
a session's turns on one replica), `stream`, weight updates, pause / continue, abort, load and
health. A sampler started with an API key (SGLang's `--api-key`) gets it on every request as
`Authorization: Bearer <key>` (`SamplerClient(url, api_key=...)`). Connection failures (nothing listening
yet, connection reset before the request was sent) are retried with exponential backoff; every call has a
timeout. A 4xx/5xx answer raises `SamplerHTTPError` carrying the server's message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from mixfleet.runner.sampler.protocol_response import decode_routed_experts

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# failures where the request never reached the server: always safe to retry
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)
# failures on idempotent reads (GET) that are also safe to retry
_READ_ERRORS = (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout)


@dataclass(frozen=True, kw_only=True)
class ClientConfig:
    """Timeouts and retry policy of one sampler client."""

    connect_timeout_s: float = 5.0        # to open a connection
    request_timeout_s: float = 600.0      # a whole /generate (long generations are legitimate)
    control_timeout_s: float = 120.0      # health, info, pause, abort; weight updates use request_timeout_s
    max_retries: int = 5                  # connection-error retries per call (0: none)
    backoff_initial_s: float = 0.1        # first retry delay; doubles per retry
    backoff_max_s: float = 5.0            # cap of one retry delay

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "request_timeout_s", "control_timeout_s", "backoff_initial_s",
                     "backoff_max_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"ClientConfig.{name} = {v!r}: must be a number > 0 (seconds)")
        if not isinstance(self.max_retries, int) or isinstance(self.max_retries, bool) or self.max_retries < 0:
            raise ValueError(f"ClientConfig.max_retries = {self.max_retries!r}: must be an integer >= 0")


class SamplerHTTPError(RuntimeError):
    """The sampler answered with an error status; `message` is its explanation."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.url, self.status, self.message = url, status, message


class SamplerUnavailable(RuntimeError):
    """The sampler could not be reached (after retries) or did not become healthy in time."""


@dataclass(frozen=True, kw_only=True)
class Load:
    """A sampler's load signal, normalized over the embedded and SGLang shapes of /get_load."""

    num_running_reqs: int
    num_waiting_reqs: int
    token_usage: float                    # share of the KV budget in use, 0..1
    raw: Any = None                       # the server's own answer

    @classmethod
    def from_json(cls, obj: Any) -> Load:
        rows = obj if isinstance(obj, list) else [obj]
        rows = [r for r in rows if isinstance(r, Mapping)]

        def pick(r: Mapping, *names: str) -> float:
            for n in names:
                if n in r:
                    return float(r[n] or 0)
            return 0.0

        usage = [float(r["token_usage"]) for r in rows if "token_usage" in r]
        return cls(num_running_reqs=int(sum(pick(r, "num_running_reqs", "num_reqs") for r in rows)),
                   num_waiting_reqs=int(sum(pick(r, "num_waiting_reqs", "num_waiting") for r in rows)),
                   token_usage=max(usage) if usage else 0.0, raw=obj)


def _message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return resp.text.strip() or resp.reason_phrase
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return resp.text.strip()


def routed_experts(response: Mapping[str, Any], *, num_layers: int, top_k: int,
                   routed_experts_start_len: int = 0) -> np.ndarray | None:
    """The experts of a /generate response (embedded or real SGLang, same encoding): int32 array
    [prompt + completion - 1 - routed_experts_start_len, num_layers, top_k], row i the experts of position
    routed_experts_start_len + i; None when the response carries no `meta_info.routed_experts`. ValueError
    if the payload's size disagrees with the response's token counts."""
    meta = response.get("meta_info") or {}
    payload = meta.get("routed_experts")
    if payload is None:
        return None
    rows = int(meta["prompt_tokens"]) + int(meta["completion_tokens"]) - 1 - routed_experts_start_len
    return decode_routed_experts(payload, num_layers=num_layers, top_k=top_k, rows=max(rows, 0))


class SamplerClient:
    """Talks to one sampler over HTTP. Use as `async with SamplerClient(url) as c: ...`."""

    def __init__(self, base_url: str, *, config: ClientConfig | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.config = config or ClientConfig()
        timeout = httpx.Timeout(self.config.request_timeout_s, connect=self.config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, limits=limits, transport=transport,
                                       trust_env=False, headers=headers)

    async def __aenter__(self) -> SamplerClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # ---- plumbing ---------------------------------------------------------------------------
    async def _request(self, method: str, path: str, *, json_body: Any = None, headers: Mapping[str, str] | None = None,
                       timeout_s: float | None = None, check: bool = True) -> httpx.Response:
        retry_on = _CONNECT_ERRORS + (_READ_ERRORS if method == "GET" else ())
        delay = self.config.backoff_initial_s
        timeout = httpx.Timeout(timeout_s, connect=self.config.connect_timeout_s) if timeout_s else None
        for attempt in range(self.config.max_retries + 1):
            try:
                kw: dict[str, Any] = {"headers": dict(headers or {})}
                if timeout is not None:
                    kw["timeout"] = timeout
                if json_body is not None:
                    kw["json"] = json_body
                resp = await self._http.request(method, path, **kw)
                break
            except retry_on as e:
                if attempt == self.config.max_retries:
                    raise SamplerUnavailable(f"{self.base_url}{path}: {type(e).__name__}: {e} "
                                             f"(after {attempt + 1} attempts)") from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.backoff_max_s)
        if check and resp.status_code >= 400:
            raise SamplerHTTPError(f"{self.base_url}{path}", resp.status_code, _message(resp))
        return resp

    async def _get_json(self, path: str) -> Any:
        return (await self._request("GET", path, timeout_s=self.config.control_timeout_s)).json()

    async def _post_json(self, path: str, body: Any, *, timeout_s: float | None = None, check: bool = True) -> Any:
        resp = await self._request("POST", path, json_body=body, timeout_s=timeout_s or self.config.control_timeout_s,
                                   check=check)
        try:
            return resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {"message": resp.text}

    # ---- generation -------------------------------------------------------------------------
    async def generate(self, payload: Mapping[str, Any], *, routing_key: str | None = None) -> Any:
        """POST /generate with a full SGLang body; returns the response dict (a list for a batch)."""
        if payload.get("stream"):
            raise ValueError("generate(): use stream() for stream=True")
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else None
        resp = await self._request("POST", "/generate", json_body=dict(payload), headers=headers)
        return resp.json()

    async def generate_ids(self, input_ids: list[int], sampling_params: Mapping[str, Any] | None = None, *,
                           rid: str | None = None, return_logprob: bool = True, top_logprobs_num: int = 0,
                           return_sampling_mask: bool = False, sampling_logprobs_mode: str | None = None,
                           routing_key: str | None = None, return_routed_experts: bool = False,
                           routed_experts_start_len: int = 0) -> dict:
        """Token-in, token-out generation of one prompt (the agent loop's call); with return_routed_experts
        (a MoE server started with --enable-return-routed-experts) read the record with `routed_experts`."""
        body: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params or {}),
                                "return_logprob": return_logprob}
        if rid is not None:
            body["rid"] = rid
        if top_logprobs_num:
            body["top_logprobs_num"] = top_logprobs_num
        if return_sampling_mask:
            body["return_sampling_mask"] = True
        if sampling_logprobs_mode is not None:
            body["sampling_logprobs_mode"] = sampling_logprobs_mode
        if return_routed_experts:
            body["return_routed_experts"] = True
            if routed_experts_start_len:
                body["routed_experts_start_len"] = routed_experts_start_len
        return await self.generate(body, routing_key=routing_key)

    async def stream(self, payload: Mapping[str, Any], *, routing_key: str | None = None) -> AsyncIterator[dict]:
        """POST /generate with stream=True; yields each server-sent chunk until `[DONE]`."""
        body = {**payload, "stream": True}
        headers = {ROUTING_KEY_HEADER: routing_key} if routing_key else {}
        delay = self.config.backoff_initial_s
        for attempt in range(self.config.max_retries + 1):
            try:
                async with self._http.stream("POST", "/generate", json=body, headers=headers) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise SamplerHTTPError(f"{self.base_url}/generate", resp.status_code, _message(resp))
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            return
                        chunk = json.loads(data)
                        if isinstance(chunk, Mapping) and "error" in chunk:
                            err = chunk["error"]
                            msg = err.get("message", str(err)) if isinstance(err, Mapping) else str(err)
                            raise SamplerHTTPError(f"{self.base_url}/generate", 200, msg)
                        yield chunk
                return
            except _CONNECT_ERRORS as e:
                if attempt == self.config.max_retries:
                    raise SamplerUnavailable(f"{self.base_url}/generate: {type(e).__name__}: {e}") from e
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.config.backoff_max_s)

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> Any:
        """Abort one request (its /generate returns its partial tokens, finish_reason abort) or all."""
        if (rid is None) == (not abort_all):
            raise ValueError("abort(): give a rid or abort_all=True")
        return await self._post_json("/abort_request", {"abort_all": True} if abort_all else {"rid": rid})

    # ---- weights ----------------------------------------------------------------------------
    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                       abort_all_requests: bool = False) -> dict:
        """Load a checkpoint folder into the sampler; returns {"success", "message", ...} (never raises on
        success=false: the old weights keep serving and the caller decides)."""
        body: dict[str, Any] = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._post_json("/update_weights_from_disk", body, timeout_s=self.config.request_timeout_s,
                                     check=False)

    async def update_weight_version(self, new_version: str) -> dict:
        return await self._post_json("/update_weight_version", {"new_version": new_version})

    async def weight_version(self) -> str:
        """The version the sampler serves now (SGLang's /get_weight_version, or /model_info's field)."""
        try:
            return str((await self._get_json("/get_weight_version"))["weight_version"])
        except SamplerHTTPError as e:
            if e.status != 404:
                raise
            return str((await self.model_info())["weight_version"])

    # ---- control ----------------------------------------------------------------------------
    async def pause(self, mode: str = "in_place") -> dict:
        """Pause generation: "in_place" keeps running requests and their KV; "retract" re-queues them;
        "abort" ends them (each returns its partial output)."""
        return await self._post_json("/pause_generation", {"mode": mode})

    async def resume(self) -> dict:
        return await self._post_json("/continue_generation", {})

    async def flush_cache(self) -> bool:
        """True when the prefix cache was flushed (False while requests run)."""
        resp = await self._request("POST", "/flush_cache", timeout_s=self.config.control_timeout_s, check=False)
        return resp.status_code == 200

    async def load(self) -> Load:
        return Load.from_json(await self._get_json("/get_load"))

    async def model_info(self) -> dict:
        return await self._get_json("/get_model_info")

    async def server_info(self) -> dict:
        return await self._get_json("/get_server_info")

    async def health(self) -> bool:
        """One health probe: True on 200, False on 503 or no answer (no retries)."""
        try:
            resp = await self._http.get("/health", timeout=self.config.connect_timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    async def wait_healthy(self, timeout_s: float = 300.0, *, poll_s: float = 0.2) -> None:
        """Return once /health answers 200; SamplerUnavailable after timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not await self.health():
            if loop.time() > deadline:
                raise SamplerUnavailable(f"{self.base_url}: not healthy after {timeout_s:.0f} s")
            await asyncio.sleep(poll_s)
